"""The budgets of ``oal reproduce``: one frozen dataclass whose fields are every number the pipeline uses, and the
three named presets ``paper``, ``cpu`` and ``demo``.

Field names carry their stage as a prefix (``analyze_``, ``group_``, ``calib_``, ``fidelity_``, ``finetune_``,
``eval_``); each stage's completion record depends only on its own fields and those of the stages it reads (see
:mod:`oal.reproduce.pipeline`). Every field is also a ``oal reproduce`` option (``calib_max_updates`` ->
``--calib-max-updates``), so a preset is a starting point, not a fixed choice.

* ``paper``: §5.2 / App. B, C, F as written: N = 4096 for calibration and fidelity, the App. B calibration
  protocol, F.2's 512 updates × 4096 tokens, full F.3 evaluation sets. Meant for a GPU.
* ``cpu``: calibration and fidelity at N = 1024 with 100 Eq. 20 updates, 24 LoRA updates × 512 tokens, perplexity
  on 4 test blocks of 1024 tokens and the first 100 items of each task (sized below from measurements).
* ``demo``: minutes on 2 cores, to show the pipeline works: N = 512, a few calibration and fine-tuning updates,
  20 task items. The conversion range stays the model's default. Its numbers mean nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..calibration.config import GLOBAL_INITS, OAL_INITS, CalibrationConfig
from ..fidelity.data import EVAL_BLOCKS, TRAIN_BLOCKS, VAL_BLOCKS
from ..kernels.registry import KERNELS, SINK_WINDOW_KERNELS
from ..training.config import MIXED_PRECISION, FinetuneConfig
from ..training.config import PRESETS as FINETUNE_PRESETS

#: Table 3's rows, in its order: the LoRA softmax reference, the four F.1 baselines, the learned global quadratic
#: (G = 1) and OAL.
PAPER_METHODS = ("softmax", "performer", "spectraformer", "dijiang", "taylorshift", "global", "oal")
#: Every name ``--methods`` accepts: ``softmax`` (the unconverted reference) and the kernel registry's names.
ALL_METHODS = tuple(dict.fromkeys(("softmax", *KERNELS, *SINK_WINDOW_KERNELS)))


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


def _check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer ≥ {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _check_indices(name: str, value: Any, *, nonempty: bool = True) -> None:
    ok = isinstance(value, tuple) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    if not ok or (nonempty and not value) or len(set(value)) != len(value):
        raise ValueError(f"{name}: expected distinct non-negative integers, got {value!r}")


def check_methods(methods: Any) -> tuple[str, ...]:
    """``methods`` as a tuple of known, distinct names (ValueError naming the unknown ones)."""
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise ValueError(f"methods: expected a sequence of method names, got {methods!r}")
    methods = tuple(methods)
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; expected names from {list(ALL_METHODS)}")
    if not methods or len(set(methods)) != len(methods):
        raise ValueError(f"methods: expected at least one method, each once, got {list(methods)}")
    return methods


@dataclass(frozen=True)
class ReproducePreset:
    """Every number of an ``oal reproduce`` run (see the module docstring). Defaults are the paper's."""

    name: str = _opt("paper", "Preset label (recorded, not used in computations).")
    methods: tuple[str, ...] = _opt(PAPER_METHODS, "Methods of Table 3 (softmax = LoRA on the unconverted model).")
    layers: str | None = _opt(None, "Converted layers, e.g. '3-26' (None: the model's default range, App. F).")
    seed: int = _opt(0, "Calibration protocol seed and the baselines' fixed random projections.")
    # analysis (§3, App. A) and grouping (App. B)
    analyze_prompts: int = _opt(40, "Short calibration / held-out prompts of the contribution analysis.")
    analyze_prompt_len: int = _opt(64, "Tokens per short prompt.")
    analyze_long_len: int = _opt(4096, "Sequence length of the prefix-length stability table (Table 4).")
    analyze_layer: int = _opt(4, "Layer of the per-head figures (Fig. 1, 2a, 5, 6).")
    analyze_head: int = _opt(0, "Query head of the per-head figures.")
    group_alpha: float | None = _opt(None, "Grouping tail fraction α (None: by family, App. B).")
    group_gamma: float | None = _opt(None, "Grouping bootstrap support γ (None: by family, App. B).")
    group_n_boot: int = _opt(1000, "Grouping bootstrap replicates B.")
    # calibration on frozen Q/K/V (Eq. 20, App. B)
    calib_seq_len: int = _opt(4096, "Calibration block length N.")
    calib_train_blocks: tuple[int, ...] = _opt(TRAIN_BLOCKS, "Calibration fitting blocks (valid split).")
    calib_val_blocks: tuple[int, ...] = _opt(VAL_BLOCKS, "Calibration validation blocks (valid split).")
    calib_max_updates: int = _opt(1000, "Calibration updates per initialisation (paper: 1000).")
    calib_patience: int = _opt(400, "Calibration early-stopping patience in updates (paper: 400).")
    calib_val_every: int = _opt(100, "Calibration validation interval in updates (paper: 100).")
    calib_train_pool: int | None = _opt(256, "Eligible query positions per calibration sequence (None: all).")
    calib_val_positions: int | None = _opt(256, "Validation positions per calibration sequence (None: all).")
    calib_global_inits: tuple[str, ...] = _opt(CalibrationConfig.global_inits, f"Learned-global inits {GLOBAL_INITS}.")
    calib_oal_inits: tuple[str, ...] = _opt(OAL_INITS, f"OAL inits {OAL_INITS} (paper: all three).")
    n_sink: int = _opt(4, "Sink/window methods: exact sink tokens.")
    window: int = _opt(64, "Sink/window methods: exact local window.")
    # frozen-attention fidelity (Table 2, App. C)
    fidelity_layers: tuple[int, ...] = _opt((4, 12, 20), "Layers of Table 2 (all query heads; converted layers).")
    fidelity_blocks: tuple[int, ...] = _opt(EVAL_BLOCKS, "Held-out blocks of the test split for Table 2.")
    fidelity_seq_len: int = _opt(4096, "Block length N of Table 2.")
    # LoRA adaptation (F.2)
    finetune_updates: int = _opt(FINETUNE_PRESETS["paper"]["updates"], "LoRA updates per method (F.2: 512).")
    finetune_block_len: int = _opt(FINETUNE_PRESETS["paper"]["block_len"], "Tokens per update (F.2: 4096).")
    finetune_val_every: int = _opt(FINETUNE_PRESETS["paper"]["val_every"], "Validation interval (F.2: 128).")
    finetune_val_blocks: int = _opt(FINETUNE_PRESETS["paper"]["val_blocks"], "Validation blocks (F.2: 32).")
    finetune_seed: int = _opt(FinetuneConfig.seed, "Training seed (F.2: 42).")
    finetune_checkpoint_every: int | None = _opt(None, "Also checkpoint every N updates (None: at validations).")
    finetune_mixed_precision: str = _opt("no", f"Mixed precision of fine-tuning, one of {MIXED_PRECISION}.")
    # evaluation (F.3)
    eval_block_len: int = _opt(4096, "WikiText perplexity block length (F.3: 4096).")
    eval_max_blocks: int | None = _opt(None, "First N test blocks for perplexity (None: all).")
    eval_limit: int | None = _opt(None, "First N items of PIQA / HellaSwag / ARC-Easy (None: all).")
    eval_batch_size: int = _opt(8, "Multiple-choice sequences per forward.")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty label, got {self.name!r}")
        object.__setattr__(self, "methods", check_methods(self.methods))
        if self.layers is not None and (not isinstance(self.layers, str) or not self.layers.strip()):
            raise ValueError(f"layers: expected a range string like '3-26' or None, got {self.layers!r}")
        for name in ("seed", "analyze_layer", "analyze_head", "finetune_seed"):
            _check_int(name, getattr(self, name), minimum=0)
        for name in (
            "analyze_prompts",
            "analyze_prompt_len",
            "analyze_long_len",
            "group_n_boot",
            "calib_seq_len",
            "calib_max_updates",
            "calib_val_every",
            "n_sink",
            "window",
            "fidelity_seq_len",
            "finetune_updates",
            "finetune_block_len",
            "finetune_val_every",
            "finetune_val_blocks",
            "eval_batch_size",
        ):
            _check_int(name, getattr(self, name))
        _check_int("calib_patience", self.calib_patience, minimum=0)
        _check_int("eval_block_len", self.eval_block_len, minimum=2)
        for name in (
            "calib_train_pool",
            "calib_val_positions",
            "finetune_checkpoint_every",
            "eval_max_blocks",
            "eval_limit",
        ):
            _check_int(name, getattr(self, name), optional=True)
        for name in ("calib_train_blocks", "calib_val_blocks", "fidelity_layers", "fidelity_blocks"):
            _check_indices(name, getattr(self, name))
        overlap = sorted(set(self.calib_train_blocks) & set(self.calib_val_blocks))
        if overlap:
            raise ValueError(f"calib_val_blocks: expected blocks disjoint from calib_train_blocks, both hold {overlap}")
        for name in ("group_alpha", "group_gamma"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite number or None, got {v!r}")
        # the downstream configs validate the rest (inits, pool vs positions per update, mixed precision)
        for what, build in (("calib_", self.calibration_config), ("finetune_", self.finetune_config)):
            try:
                build()
            except ValueError as e:
                raise ValueError(f"{what}*: {e}") from None

    # ------------------------------------------------------------------------------------------ derived configs

    def calibration_overrides(self) -> dict[str, Any]:
        """The ``config_overrides`` of :func:`oal.fidelity.cli.run_calibrate` (App. B protocol fields)."""
        return {
            "max_updates": self.calib_max_updates,
            "patience": self.calib_patience,
            "val_every": self.calib_val_every,
            "train_pool": self.calib_train_pool,
            "val_positions": self.calib_val_positions,
            "global_inits": list(self.calib_global_inits),
            "oal_inits": list(self.calib_oal_inits),
        }

    def calibration_config(self) -> CalibrationConfig:
        return CalibrationConfig.from_dict({**CalibrationConfig().to_dict(), **self.calibration_overrides()})

    def finetune_config(self) -> FinetuneConfig:
        """F.2's protocol with this preset's budget (every other field at the paper's value)."""
        return FinetuneConfig(
            updates=self.finetune_updates,
            block_len=self.finetune_block_len,
            val_every=self.finetune_val_every,
            val_blocks=self.finetune_val_blocks,
            seed=self.finetune_seed,
            checkpoint_every=self.finetune_checkpoint_every,
            mixed_precision=self.finetune_mixed_precision,
            preset=f"reproduce:{self.name}",
        )

    # --------------------------------------------------------------------------------------------- conversions

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def replace(self, **overrides: Any) -> ReproducePreset:
        """A copy with fields replaced (ValueError naming unknown fields); list values become tuples."""
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise ValueError(f"overrides: unknown fields {unknown}; expected names from {sorted(FIELDS)}")
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
        return dataclasses.replace(self, **fixed)


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(ReproducePreset)}

PRESETS: dict[str, ReproducePreset] = {
    "paper": ReproducePreset(name="paper"),
    # Sized from measurements on the 2-core CPU (docs/results/reproduce): a baseline's Eq. 20 update costs ~0.3 s at
    # N = 4096 (1000 updates x 24 layers would be ~2 h per baseline), so the cpu preset calibrates at N = 1024 on
    # 100 updates and fine-tunes 24 x 512 tokens; the whole seven-method run takes about an hour.
    "cpu": ReproducePreset(
        name="cpu",
        calib_seq_len=1024,
        calib_max_updates=100,
        calib_patience=100,
        calib_val_every=50,
        calib_train_pool=64,
        calib_val_positions=128,
        fidelity_blocks=(0, 1, 2, 3),
        fidelity_seq_len=1024,
        finetune_updates=24,
        finetune_block_len=512,
        finetune_val_every=8,
        finetune_val_blocks=4,
        eval_block_len=1024,
        eval_max_blocks=4,
        eval_limit=100,
    ),
    # Minutes on 2 cores: every stage runs, on tiny budgets; the conversion range stays the model's default. With
    # eval_limit 20 and 40 analysis prompts it took 17.6 min on SmolLM2 (1 thread, load ~4), evaluation ~2/3 of it.
    "demo": ReproducePreset(
        name="demo",
        analyze_prompts=20,
        analyze_long_len=512,
        group_n_boot=200,
        calib_seq_len=512,
        calib_train_blocks=(16, 17),
        calib_val_blocks=(24,),
        calib_max_updates=10,
        calib_patience=10,
        calib_val_every=5,
        calib_train_pool=32,
        calib_val_positions=32,
        calib_global_inits=("taylor",),
        calib_oal_inits=("global",),
        fidelity_blocks=(0, 1),
        fidelity_seq_len=512,
        finetune_updates=4,
        finetune_block_len=128,
        finetune_val_every=2,
        finetune_val_blocks=2,
        eval_block_len=512,
        eval_max_blocks=2,
        eval_limit=10,
    ),
}
DEFAULT_PRESET = "cpu"


def preset(name: str, /, **overrides: Any) -> ReproducePreset:
    """The named preset (``paper``, ``cpu``, ``demo``) with fields overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name].replace(**overrides)
