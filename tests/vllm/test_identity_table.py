"""Every field of vLLM's ModelConfig, CacheConfig and ParallelConfig is classified for the identity.

``connectors/vllm/identity.py:FIELDS`` says of each field whether it enters the
model identity that roots tierkv's keys, is part of the layout, is refused, or
does not change the KV of a token sequence (with the reason). These tests fail
when the installed vLLM has a field the table does not know (an upgrade must
not silently widen a blind spot) or the table names a field vLLM no longer has.
"""

from __future__ import annotations

import pytest
from vllm.config import CacheConfig, ModelConfig, ParallelConfig

from tierkv.connectors.vllm.identity import CLASSES, FIELDS, config_field_names

CLASSES_OF = {"ModelConfig": ModelConfig, "CacheConfig": CacheConfig, "ParallelConfig": ParallelConfig}


@pytest.mark.parametrize("name", sorted(CLASSES_OF))
def test_every_installed_field_is_classified(name):
    installed = set(config_field_names(CLASSES_OF[name]))
    assert installed, f"{name}: no fields found (is it still a dataclass?)"
    unclassified = sorted(installed - set(FIELDS[name]))
    assert not unclassified, (f"{name} has fields connectors/vllm/identity.py does not classify: "
                              f"{unclassified}; say for each whether it changes the KV of a token sequence")


@pytest.mark.parametrize("name", sorted(CLASSES_OF))
def test_the_table_names_no_field_vllm_lacks(name):
    stale = sorted(set(FIELDS[name]) - set(config_field_names(CLASSES_OF[name])))
    assert not stale, f"connectors/vllm/identity.py classifies {name} fields vLLM does not have: {stale}"


@pytest.mark.parametrize("name", sorted(CLASSES_OF))
def test_each_entry_has_a_class_and_a_reason(name):
    for field, (cls, reason) in FIELDS[name].items():
        assert cls in CLASSES, (name, field, cls)
        assert isinstance(reason, str) and len(reason) > 10, (name, field, reason)
