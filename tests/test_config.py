"""Config: sizes with units, TOML + TIERKV_* env, and fuzzed invalid values that must name their field."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.config import (
    HashingConfig,
    L1Config,
    L2Config,
    L3Config,
    L4Config,
    StoreConfig,
    env_overrides,
    parse_size,
)

SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(StoreConfig) if f.default_factory is not dataclasses.MISSING}
TOP_LEVEL = [f.name for f in dataclasses.fields(StoreConfig) if f.name not in SECTIONS]
FIELDS = [(s, f.name) for s, factory in SECTIONS.items() for f in dataclasses.fields(factory())]
FUZZ = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# -- sizes --------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), (1024, 1024), ("1024", 1024), (0, 0),
    ("1.5GB", 1_500_000_000), (" 4 kib ", 4096), ("2TiB", 2 * 2**40), ("7b", 7), ("3K", 3000),
])
def test_sizes_parse(text, expected):
    assert parse_size(text, "l2.capacity") == expected
    assert L2Config(capacity=text).capacity == expected


@given(st.integers(0, 10**6), st.sampled_from(sorted(UNITS)), st.booleans(), st.booleans())
@FUZZ
def test_any_count_with_any_unit_parses(n, unit, space, upper):
    unit_text = unit.upper() if upper else unit
    assert parse_size(f"{n}{' ' if space else ''}{unit_text}", "l3.capacity") == n * UNITS[unit]


@given(st.one_of(
    st.integers(max_value=-1),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.binary(max_size=4),
    st.text(max_size=12).filter(lambda s: not _looks_like_size(s)),
    st.from_regex(r"\A[0-9]{1,4}(xb|gibi|mbytes|q|ki|GiBs|-MiB)\Z"),
    st.from_regex(r"\A-[0-9]{1,4}(GiB|MiB|)\Z"),
    st.from_regex(r"\A[1-9][0-9]{320,400}(GiB|)\Z"),
))
@FUZZ
def test_bad_sizes_name_the_field(value):
    with pytest.raises(ValueError, match=r"^l2\.capacity: expected a size like '8GiB'"):
        L2Config(capacity=value)
    with pytest.raises(ValueError, match=r"^l3\.capacity: "):
        StoreConfig.from_dict({"l3": {"capacity": value}})


def _looks_like_size(s: str) -> bool:
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", s)
    return bool(m) and m.group(2).lower() in UNITS


# -- every field rejects values of the wrong kind -------------------------------

JUNK = st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
                 st.binary(min_size=1, max_size=3), st.just(object()), st.just(float("nan")))


@given(st.sampled_from(FIELDS), JUNK)
@FUZZ
def test_junk_in_any_section_field_names_that_field(where, value):
    section, name = where
    with pytest.raises(ValueError) as err:
        StoreConfig.from_dict({section: {name: value}})
    assert str(err.value).startswith(f"{section}.{name}: "), str(err.value)
    with pytest.raises(ValueError, match=rf"^{section}\.{name}: "):
        SECTIONS[section]().__class__(**{name: value})


@given(st.sampled_from(TOP_LEVEL), JUNK)
@FUZZ
def test_junk_in_a_top_level_field_names_it(name, value):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        StoreConfig.from_dict({name: value})


def _bad_value_for(default):
    """Values of the right Python type but outside what the field allows."""
    if isinstance(default, bool):
        return st.one_of(st.integers(0, 1), st.sampled_from(["yes", "true", "1"]))
    if isinstance(default, int):
        return st.one_of(st.integers(max_value=-1), st.text(max_size=4), st.floats(allow_nan=False))
    if isinstance(default, float):
        return st.one_of(st.text(max_size=4), st.just(float("nan")))
    return st.one_of(st.integers(), st.floats())


INT_FLOAT_BOOL = [(s, n) for s, n in FIELDS
                  if isinstance(getattr(SECTIONS[s](), n), (int, float)) and (s, n) not in
                  {("l2", "capacity"), ("l3", "capacity")}]


@given(st.data())
@FUZZ
def test_out_of_range_numbers_and_bools_name_the_field(data):
    section, name = data.draw(st.sampled_from(INT_FLOAT_BOOL))
    default = getattr(SECTIONS[section](), name)
    value = data.draw(_bad_value_for(default))
    with pytest.raises(ValueError, match=rf"^{section}\.{name}: "):
        StoreConfig.from_dict({section: {name: value}})


@pytest.mark.parametrize("section,name,value", [
    ("l1", "num_blocks", -1), ("l1", "device", "tpu"), ("l1", "device", "cpu:x"), ("l1", "device", "cuda:-1"),
    ("l2", "shared_name", "a/b"), ("l2", "shared_name", "x" * 65), ("l3", "path", ""),
    ("l3", "read_depth", 0), ("l3", "read_depth", 65), ("l3", "read_depth", 2.0),
    ("l4", "url", "http://x"), ("l4", "url", "redis"), ("l4", "timeout_ms", 0), ("l4", "timeout_ms", 60_001),
    ("l4", "breaker_reset_s", 0), ("l4", "breaker_failures", 0),
    ("policy", "name", "mru"), ("policy", "write", "write_around"), ("policy", "half_life", 0),
    ("policy", "half_life", -1.5), ("policy", "half_life", 10**400),
    ("hashing", "algorithm", "md5"), ("cost", "recompute_us_per_token", -1),
    ("cost", "l3_us_per_token", float("nan")),
])
def test_specific_bad_values_name_the_field_and_what_is_allowed(section, name, value):
    with pytest.raises(ValueError, match=rf"^{section}\.{name}: expected "):
        StoreConfig.from_dict({section: {name: value}})


@pytest.mark.parametrize("algorithm,key", [
    ("blake2b", ""), ("blake2b", "zz"), ("blake2b", "ab" * 65), ("blake2b", 5), ("blake2b", b"\x01"),
    ("xxh3_128", 5), ("sha256", "not hex"), ("xxh3_128", ["ab"]),
])
def test_bad_hashing_keys_name_the_field(algorithm, key):
    with pytest.raises(ValueError, match=r"^hashing\.key: "):
        HashingConfig(algorithm=algorithm, key=key)


def test_valid_sections_build_and_are_frozen():
    cfg = StoreConfig.from_dict({
        "model_id": "m", "model_revision": "r", "namespace": "tenant",
        "l1": {"num_blocks": 64, "device": "cpu"},
        "l2": {"capacity": "512 MiB", "shared_name": "node-a_1.x", "pin": False},
        "l3": {"path": "/tmp/x", "capacity": "8GiB", "direct_io": False},
        "l4": {"url": "redis://localhost:6379/0", "timeout_ms": 50},
        "policy": {"name": "lru", "write": "write_through", "half_life": 10},
        "hashing": {"algorithm": "blake2b", "key": "00ff" * 8},
        "l3_enabled": False,
    })
    assert cfg.l2.capacity == 512 * 2**20 and cfg.l3.capacity == 8 * 2**30
    assert cfg.l1 == L1Config(64, "cpu") and cfg.l4.timeout_ms == 50 and cfg.policy.half_life == 10.0
    assert cfg.l3_enabled is False and cfg.namespace == "tenant"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model_id = "x"
    assert L1Config(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize("section", ["l1", "l2", "l3", "l4", "policy", "hashing", "cost"])
def test_a_section_of_the_wrong_type_is_an_error(section):
    with pytest.raises(ValueError, match=rf"^{section}: expected a table"):
        StoreConfig.from_dict({section: 5})
    with pytest.raises(ValueError, match=rf"^{section}: expected "):
        StoreConfig(**{section: {"capacity": 5}})


def test_unknown_sections_and_keys_name_themselves():
    with pytest.raises(ValueError, match=r"^l5: unknown setting; expected one of .*'l4'"):
        StoreConfig.from_dict({"l5": {}})
    with pytest.raises(ValueError, match=r"^l2\.size: unknown setting; expected one of .*'capacity'"):
        StoreConfig.from_dict({"l2": {"size": "1GiB"}})


# -- TOML file and environment ------------------------------------------------

def test_toml_then_env_then_overrides(tmp_path):
    path = tmp_path / "tierkv.toml"
    path.write_text('model_id = "from-file"\n[l2]\ncapacity = "2GiB"\n[l3]\npath = "/data/l3"\ncapacity = 4096\n')
    cfg = StoreConfig.load(path, env={"TIERKV_L2_CAPACITY": "512 MiB", "HOME": "/root"})
    assert (cfg.model_id, cfg.l2.capacity, cfg.l3.path, cfg.l3.capacity) == ("from-file", 512 * 2**20, "/data/l3", 4096)
    cfg = StoreConfig.load(path, env={"TIERKV_MODEL_ID": "from-env"}, overrides={"l3": {"capacity": "1KiB"}})
    assert (cfg.model_id, cfg.l2.capacity, cfg.l3.capacity) == ("from-env", 2 * 2**30, 1024)


def test_bad_toml_names_the_file_and_bad_values_the_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[l2\ncapacity = 1\n")
    with pytest.raises(ValueError, match=r"bad\.toml: not valid TOML"):
        StoreConfig.load(path, env={})
    path.write_text('[policy]\nname = "random"\n')
    with pytest.raises(ValueError, match=r"^policy\.name: expected one of .*'lru'.*got 'random'"):
        StoreConfig.load(path, env={})


@pytest.mark.parametrize("env,expected", [
    ({"TIERKV_L1_NUM_BLOCKS": "128"}, ("l1", "num_blocks", 128)),
    ({"TIERKV_L2_PIN": "false"}, ("l2", "pin", False)),
    ({"TIERKV_L3_DIRECT_IO": "0"}, ("l3", "direct_io", False)),
    ({"TIERKV_POLICY_HALF_LIFE": "12.5"}, ("policy", "half_life", 12.5)),
    ({"TIERKV_L4_URL": "redis://h:1"}, ("l4", "url", "redis://h:1")),
    ({"TIERKV_L3_ENABLED": "false"}, (None, "l3_enabled", False)),
    ({"TIERKV_NAMESPACE": "tenant-7"}, (None, "namespace", "tenant-7")),
    ({"TIERKV_CACHE_DIR": "/x", "TIERKV_LOG_LEVEL": "debug", "OTHER": "1"}, (None, "model_id", "unknown-model")),
    # Read by the CLI, the kernels, the native copy loop and the vLLM connector, not the store.
    ({"TIERKV_CONFIG": "/etc/t.toml", "TIERKV_KERNELS": "reference", "TIERKV_NATIVE": "0",
      "TIERKV_VLLM_SAVE_ASYNC": "1"}, (None, "model_id", "unknown-model")),
])
def test_env_overrides_apply(env, expected):
    cfg = StoreConfig.load(None, env=env)
    section, name, value = expected
    assert getattr(getattr(cfg, section) if section else cfg, name) == value


@pytest.mark.parametrize("env,field", [
    ({"TIERKV_L2_CAPACITY": "lots"}, "l2.capacity"),
    ({"TIERKV_L2_CAPACITY": "-1GiB"}, "l2.capacity"),
    ({"TIERKV_L1_NUM_BLOCKS": "many"}, "l1.num_blocks"),
    ({"TIERKV_L1_NUM_BLOCKS": "-3"}, "l1.num_blocks"),
    ({"TIERKV_L3_DIRECT_IO": "maybe"}, "l3.direct_io"),
    ({"TIERKV_POLICY_HALF_LIFE": "soon"}, "policy.half_life"),
    ({"TIERKV_POLICY_NAME": "mru"}, "policy.name"),
    ({"TIERKV_L4_TIMEOUT_MS": "1.5"}, "l4.timeout_ms"),
    ({"TIERKV_L3_ENABLED": "perhaps"}, "l3_enabled"),
    ({"TIERKV_L2_BOGUS": "1"}, "TIERKV_L2_BOGUS"),
    ({"TIERKV_BOGUS": "1"}, "TIERKV_BOGUS"),
    ({"TIERKV_L9_CAPACITY": "1"}, "TIERKV_L9_CAPACITY"),
])
def test_bad_env_vars_name_the_field(env, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        StoreConfig.load(None, env=env)


@given(st.sampled_from(FIELDS), st.text(alphabet="abcxyz!?-", min_size=1, max_size=6))
@FUZZ
def test_env_junk_names_the_field_or_is_a_valid_string(where, raw):
    section, name = where
    var = f"TIERKV_{section}_{name}".upper()
    default = getattr(SECTIONS[section](), name)
    try:
        cfg = StoreConfig.load(None, env={var: raw})
    except ValueError as exc:
        assert str(exc).startswith(f"{section}.{name}: "), str(exc)
        return
    # Accepted: only a free-form string field may take arbitrary letters.
    assert isinstance(default, str) and not isinstance(default, bool)
    assert getattr(getattr(cfg, section), name) in (raw, parse_size(raw, "x") if name == "capacity" else raw)


# Read by the CLI, kernels, native copy loop, model cache and the test suite (CI sets the last two).
OTHER_VARS = ("TIERKV_CACHE_DIR", "TIERKV_LOG_LEVEL", "TIERKV_CONFIG", "TIERKV_KERNELS", "TIERKV_NATIVE",
              "TIERKV_MODELS_DIR", "TIERKV_REQUIRE_SERVERS", "TIERKV_SHARED")


def test_variables_other_parts_read_are_not_store_settings():
    env = {var: "1" for var in OTHER_VARS}
    assert env_overrides(env) == {}
    assert StoreConfig.load(None, env=env) == StoreConfig()


@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12))
@FUZZ
def test_unknown_env_names_are_named(suffix):
    var = "TIERKV_" + suffix
    known = {f"TIERKV_{s}_{n}".upper() for s, n in FIELDS} | {f"TIERKV_{n}".upper() for n in TOP_LEVEL}
    if var in known or var.startswith("TIERKV_VLLM_") or var in OTHER_VARS:
        return
    with pytest.raises(ValueError, match=rf"^{var}: unknown setting"):
        env_overrides({var: "1"})


def test_nan_and_inf_are_never_silently_accepted_as_sizes():
    for value in (math.inf, -math.inf, math.nan, "inf", "nan"):
        with pytest.raises(ValueError, match=r"^l3\.capacity: "):
            L3Config(capacity=value)
    with pytest.raises(ValueError, match=r"^l4\.url: "):
        L4Config(url="ftp://x")
