"""``oal reproduce``: the whole experimental pipeline of §5 (Tables 2 and 3) as one resumable run.

Stages, each a thin call into the library module that owns it:

1. ``analyze``: contribution scores χ (Eq. 2) of every layer and head (:func:`oal.analysis.cli.run_analyze`);
2. ``group``: App. B grouping of every head (:func:`oal.analysis.cli.run_group`) -> ``group/groups.json``;
3. ``calibrate.<kernel>``: output-matching calibration (Eq. 20) of each kernel the methods need, on the converted
   layers (:func:`oal.fidelity.cli.run_calibrate`); ``calibrate/oal`` also holds the learned global quadratic
   (``calibrate/oal/global``), and sink/window kernels start from their plain calibrated kernel (``init_from``);
4. ``fidelity``: Table 2 on the preset's fidelity layers (:func:`oal.fidelity.cli.run_fidelity`);
5. ``finetune.<method>``: conversion of the converted layers from the calibrated parameters
   (:func:`oal.conversion.convert_model`) and LoRA adaptation (F.2, :func:`oal.training.finetune`); ``softmax``
   is LoRA on the unconverted model with the same budget;
6. ``evaluate.<method>``: the best checkpoint (:func:`oal.training.load_finetuned`) on WikiText test PPL and
   zero-shot PIQA / HellaSwag / ARC-Easy (F.3, :func:`oal.evaluation.evaluate`);
7. ``report``: ``report.md`` and ``reproduce.json`` (:mod:`oal.reproduce.report`).

Output directory::

    run.json                   the run's configuration (checked on every restart) and its invocations
    stages/<stage>.json        completion record: the configuration slice the stage depended on, wall/CPU time
    analyze/ group/ calibrate/<kernel>/ fidelity/ finetune/<method>/ evaluate/<method>.json
    report.md  reproduce.json

Resuming: every file is written atomically; a stage whose record exists (with the same configuration slice) and
whose outputs exist is skipped, so a rerun does no work and a killed run continues at the first unfinished stage.
Inside a stage the owning module resumes on its own (calibration per layer, fine-tuning from its last checkpoint,
Q/K/V capture per block). A directory that holds a run with another configuration is refused
(:class:`ReproduceConflict`), never silently reused. Finished stages keep their first wall time.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..io import provenance, read_json, write_json
from ..kernels.registry import SINK_WINDOW_KERNELS
from ..kernels.sink_window import split_sink_window_name
from .presets import ReproducePreset

logger = logging.getLogger(__name__)

FORMAT = "oal-reproduce/1"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_OUT = Path("runs/reproduce")
#: Q/K/V capture cache shared with ``oal calibrate`` / ``oal fidelity`` (keyed by content, safe to share).
DEFAULT_CACHE = Path("runs/qkv")
STAGES_DIR = "stages"


class ReproduceConflict(ValueError):
    """The output directory holds a run (or a stage) made with another configuration."""


@dataclass(frozen=True)
class Stage:
    """One unit of work: ``depends`` is the configuration slice it was computed from (recorded and compared on
    restart), ``outputs`` the files whose presence, with the record, marks it done."""

    name: str
    depends: dict[str, Any]
    outputs: tuple[Path, ...]
    run: Callable[[], None]


def data_files() -> tuple[str, ...]:
    """Files a local data folder must hold (the shared data's layout, see its SOURCES.md)."""
    from ..evaluation.tasks import TASKS

    wikitext = ("wikitext-2-raw/wiki.valid.raw", "wikitext-2-raw/wiki.test.raw")
    return wikitext + tuple(f for spec in TASKS.values() for f in spec.local_files)


def check_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The data folder (``data_dir``, else ``$OAL_DATA_DIR``) after checking it holds every file the pipeline
    reads; None when neither is set (the library then falls back to the Hugging Face Hub)."""
    from ..evaluation.utils import resolve_data_dir

    try:
        folder = resolve_data_dir(data_dir)
    except FileNotFoundError as e:
        raise ValueError(f"data: {str(e).split(': ', 1)[-1]}") from None
    if folder is None:
        logger.warning("no --data and no $OAL_DATA_DIR: text and tasks come from the Hugging Face Hub if reachable")
        return None
    missing = [f for f in data_files() if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"data: {folder} lacks {missing} (expected the layout of the shared data folder)")
    return folder.resolve()


def _differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf where two JSON-like values differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in _differences(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def _jsonable(x: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists), so recorded and current slices compare equal."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Reproduction:
    """One ``oal reproduce`` run: ``preset`` on ``model`` with the data of ``data_dir``, written to ``out``.

    Args:
        preset: every number of the run (:class:`oal.reproduce.presets.ReproducePreset`).
        model: model name, local directory or Hub id (:func:`oal.models.load_model`).
        out: output directory (layout in the module docstring); resumed when it holds the same run.
        data_dir: data folder (default ``$OAL_DATA_DIR``), checked for every needed file up front.
        cache: Q/K/V capture cache root.
        progress: show the stage bar and the stages' own bars.

    :meth:`prepare` validates everything that can be validated without running a stage (model, layers, data,
    the output directory's configuration); :meth:`run` runs the remaining stages and returns ``reproduce.json``.
    """

    def __init__(
        self,
        preset: ReproducePreset,
        *,
        model: str = DEFAULT_MODEL,
        out: str | os.PathLike = DEFAULT_OUT,
        data_dir: str | os.PathLike | None = None,
        cache: str | os.PathLike = DEFAULT_CACHE,
        progress: bool = True,
    ) -> None:
        if not isinstance(preset, ReproducePreset):
            raise ValueError(f"preset: expected a ReproducePreset, got {type(preset).__name__}")
        self.preset = preset
        self.model = str(model)
        self.out = Path(out)
        self.data_dir = check_data_dir(data_dir)
        self.cache = Path(cache)
        self.progress = progress
        self.layers: list[int] = []
        self.fixed: frozenset[str] = frozenset()
        self.model_source = ""
        self._prepared = False

    # ---------------------------------------------------------------------------------------------------- paths

    @property
    def groups_path(self) -> Path:
        return self.out / "group" / "groups.json"

    def calib_dir(self, kernel: str) -> Path:
        """Where ``kernel``'s calibration lives; the learned global quadratic is calibrated with OAL."""
        return self.out / "calibrate" / "oal" / "global" if kernel == "global" else self.out / "calibrate" / kernel

    def finetune_dir(self, method: str) -> Path:
        return self.out / "finetune" / method

    def eval_path(self, method: str) -> Path:
        return self.out / "evaluate" / f"{method}.json"

    # --------------------------------------------------------------------------------------------- validation

    def prepare(self) -> None:
        """Load the model once to resolve the converted layers and check the layer-dependent options, then
        open ``run.json`` (created, or checked against this configuration: :class:`ReproduceConflict`)."""
        if self._prepared:
            return
        from ..conversion import default_layers, parse_layers
        from ..fidelity.capture import format_indices
        from ..models import attention_spec, load_model

        p = self.preset
        model = load_model(self.model)
        spec = attention_spec(model)
        self.model_source = str(getattr(model, "oal_source", ""))
        self.layers = default_layers(model) if p.layers is None else parse_layers(p.layers, spec.num_layers)
        del model
        self.fixed = self._fixed_kernels(spec)
        outside = [i for i in p.fidelity_layers if i not in self.layers]
        if outside:
            raise ValueError(
                f"fidelity_layers: expected converted (hence calibrated) layers, {format_indices(self.layers)}; got "
                f"{outside} outside them"
            )
        if not (p.analyze_layer < spec.num_layers and p.analyze_head < spec.num_heads):
            raise ValueError(
                f"analyze_layer, analyze_head: expected a layer < {spec.num_layers} and a head < {spec.num_heads}, "
                f"got {p.analyze_layer}, {p.analyze_head}"
            )
        from ..data import load_text

        for split in ("valid", "test"):  # a bad data folder fails here, before run.json is written
            load_text(split, data_dir=self.data_dir)
        self._open_run()
        stages = self.stages()
        for stage in stages:  # refuse before doing any work
            self._record(stage)
        self._prepared = True

    def _fixed_kernels(self, spec) -> frozenset[str]:
        """Baselines with nothing to calibrate (Performer: fixed random features, F.1): they are converted with
        their seeded initial values, which is what a calibration would return."""
        from ..kernels.registry import BASELINES, build_kernel

        fixed = set()
        for m in self.preset.methods:
            if m in BASELINES:
                kernel = build_kernel(
                    m,
                    num_heads=spec.num_heads,
                    num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim,
                    layer_idx=self.layers[0],
                    seed=self.preset.seed,
                )
                if not any(p.requires_grad for p in kernel.parameters()):
                    fixed.add(m)
        return frozenset(fixed)

    def config(self) -> dict[str, Any]:
        """What identifies the run (compared with ``run.json`` on restart)."""
        return _jsonable(
            {
                "format": FORMAT,
                "model": self.model,
                "model_source": self.model_source,
                "data_dir": None if self.data_dir is None else str(self.data_dir),
                "converted_layers": self.layers,
                "preset": self.preset.to_dict(),
            }
        )

    def _open_run(self) -> None:
        path = self.out / "run.json"
        config = self.config()
        invocation = provenance(load_average=[round(x, 2) for x in os.getloadavg()])
        invocations = [invocation]
        if path.is_file():
            old = read_json(path, what="run.json")
            diff = _differences(old.get("config"), config)
            if diff:
                raise ReproduceConflict(
                    f"out: {self.out} holds a reproduction with another configuration ({'; '.join(diff[:6])}"
                    f"{'; ...' if len(diff) > 6 else ''}); use another --out or the options it was started with"
                )
            invocations = old.get("invocations", []) + invocations
        elif self.out.is_dir() and any(not f.name.startswith(".") for f in self.out.iterdir()):
            raise ReproduceConflict(f"out: {self.out} is not empty and holds no reproduction (run.json)")
        write_json(path, {"format": FORMAT, "config": config, "invocations": invocations})

    # ------------------------------------------------------------------------------------------------- stages

    def calibration_source(self, method: str) -> str | None:
        """The calibration stage a method's kernel comes from (``global`` from OAL's), None for softmax and
        kernels without trainable parameters."""
        if method == "softmax" or method in self.fixed:
            return None
        return "oal" if method == "global" else method

    def calibration_kernels(self) -> list[str]:
        """Every kernel to calibrate, in run order: OAL first (it also gives the global quadratic), then the
        others in method order, sink/window kernels after the plain kernel they start from."""
        need: list[str] = []

        def add(kernel: str) -> None:
            if kernel in SINK_WINDOW_KERNELS:
                add(self.calibration_source(split_sink_window_name(kernel)[0]))
            if kernel not in need:
                need.append(kernel)

        for m in self.preset.methods:
            src = self.calibration_source(m)
            if src is not None:
                add(src)
        return sorted(need, key=lambda k: (k != "oal", k in SINK_WINDOW_KERNELS))

    def _fields(self, prefix: str) -> dict[str, Any]:
        return {k: v for k, v in self.preset.to_dict().items() if k.startswith(prefix)}

    def _base(self) -> dict[str, Any]:
        return {"model": self.model, "model_source": self.model_source, "data_dir": self.config()["data_dir"]}

    def depends(self, stage: str) -> dict[str, Any]:
        """The configuration slice of ``stage`` (its own fields and, nested, those of the stages it reads)."""
        if not self.layers:
            raise RuntimeError("depends: call prepare() first (the converted layers are not resolved yet)")
        p = self.preset
        kind, _, what = stage.partition(".")
        if kind == "analyze":
            d = {"base": self._base(), "analyze": self._fields("analyze_"), "seed": p.seed}
        elif kind == "group":
            d = {"analyze": self.depends("analyze"), "group": self._fields("group_")}
        elif kind == "calibrate":
            d = {"base": self._base(), "kernel": what, "layers": self.layers, "seed": p.seed}
            d["calibrate"] = self._fields("calib_")
            base, sink, window = split_sink_window_name(what)
            if base == "oal":
                d["group"] = self.depends("group")
            if what in SINK_WINDOW_KERNELS:
                d["sink_window"] = {"n_sink": p.n_sink if sink else None, "window": p.window if window else None}
                d["init_from"] = self.depends(f"calibrate.{self.calibration_source(base)}")
        elif kind == "fidelity":
            d = {
                m: self.depends(f"calibrate.{src}") if (src := self.calibration_source(m)) else {"layers": self.layers}
                for m in self._converted()
            }
            d = {"methods": d, "fidelity": self._fields("fidelity_"), "seed": p.seed}
        elif kind == "finetune":
            src = self.calibration_source(what)
            d = {"base": self._base(), "method": what, "finetune": self._fields("finetune_")}
            d["calibrate"] = None if src is None else self.depends(f"calibrate.{src}")
            if what != "softmax":
                d["converted"] = {"layers": self.layers, "seed": p.seed}
        elif kind == "evaluate":
            d = {"finetune": self.depends(f"finetune.{what}"), "evaluate": self._fields("eval_")}
        elif kind == "report":
            d = {"config": self.config()}
        else:
            raise ValueError(f"stage: unknown stage {stage!r}")
        return _jsonable(d)

    def _converted(self) -> list[str]:
        return [m for m in self.preset.methods if m != "softmax"]

    def stages(self) -> list[Stage]:
        """Every stage of the run, in order."""
        out = self.out
        s = [
            Stage("analyze", self.depends("analyze"), (out / "analyze" / "analysis.json",), self._analyze),
            Stage("group", self.depends("group"), (self.groups_path,), self._group),
        ]
        for k in self.calibration_kernels():
            outputs = (self.calib_dir(k) / "calibrate.json", self.calib_dir(k) / "params.safetensors")
            s.append(
                Stage(f"calibrate.{k}", self.depends(f"calibrate.{k}"), outputs, functools.partial(self._calibrate, k))
            )
        if self._converted():
            s.append(Stage("fidelity", self.depends("fidelity"), (out / "fidelity" / "fidelity.json",), self._fidelity))
        for m in self.preset.methods:
            outputs = (self.finetune_dir(m) / "summary.json", self.finetune_dir(m) / "best" / "manifest.json")
            s.append(
                Stage(f"finetune.{m}", self.depends(f"finetune.{m}"), outputs, functools.partial(self._finetune, m))
            )
            s.append(
                Stage(
                    f"evaluate.{m}",
                    self.depends(f"evaluate.{m}"),
                    (self.eval_path(m),),
                    functools.partial(self._evaluate, m),
                )
            )
        s.append(Stage("report", self.depends("report"), (out / "report.md", out / "reproduce.json"), self._report))
        return s

    def _record_path(self, name: str) -> Path:
        return self.out / STAGES_DIR / f"{name}.json"

    def _record(self, stage: Stage) -> dict | None:
        """The stage's completion record if it is done; ReproduceConflict if it was done with another slice."""
        path = self._record_path(stage.name)
        if not path.is_file():
            return None
        record = read_json(path, what=f"stage record {stage.name}")
        diff = _differences(record.get("depends"), stage.depends)
        if diff:
            raise ReproduceConflict(
                f"out: stage {stage.name} in {self.out} was computed with other settings ({'; '.join(diff[:4])}); "
                "use another --out"
            )
        return record if all(p.is_file() for p in stage.outputs) else None

    def records(self) -> dict[str, dict]:
        """Completion records of the finished stages, by stage name."""
        return {s.name: r for s in self.stages() if (r := self._record(s)) is not None}

    def run(self) -> dict[str, Any]:
        """Run every unfinished stage; returns the content of ``reproduce.json``."""
        self.prepare()
        stages = self.stages()
        todo = {s.name for s in stages if self._record(s) is None}
        bar = Progress(
            TextColumn("[bold]reproduce[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not self.progress,
        )
        with bar:
            task = bar.add_task("", total=len(stages), completed=len(stages) - len(todo))
            for stage in stages:
                if stage.name not in todo:
                    logger.info("stage %s: done, skipped", stage.name)
                    continue
                bar.update(task, description=stage.name)
                started, t0, c0 = _utc(), time.perf_counter(), time.process_time()
                stage.run()
                missing = [str(p) for p in stage.outputs if not p.is_file()]
                if missing:
                    raise RuntimeError(f"stage {stage.name} finished without writing {missing}")
                record = {
                    "stage": stage.name,
                    "depends": stage.depends,
                    "started_utc": started,
                    "finished_utc": _utc(),
                    "wall_s": round(time.perf_counter() - t0, 2),
                    "cpu_s": round(time.process_time() - c0, 2),
                    "torch_threads": torch.get_num_threads(),
                    "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                }
                write_json(self._record_path(stage.name), record)
                logger.info("stage %s: done in %.1f s", stage.name, record["wall_s"])
                bar.advance(task)
        return read_json(self.out / "reproduce.json", what="reproduce.json")

    # ------------------------------------------------------------------------------------------ stage bodies

    def _analyze(self) -> None:
        from ..analysis.cli import run_analyze

        p = self.preset
        run_analyze(
            self.model,
            data_dir=self.data_dir,
            out=self.out / "analyze",
            prompts=p.analyze_prompts,
            prompt_len=p.analyze_prompt_len,
            long_len=p.analyze_long_len,
            layer=p.analyze_layer,
            head=p.analyze_head,
            seed=p.seed,
        )

    def _group(self) -> None:
        from ..analysis.cli import run_group

        p = self.preset
        run_group(
            self.out / "analyze" / "chi.safetensors",
            out=self.out / "group",
            alpha=p.group_alpha,
            gamma=p.group_gamma,
            n_boot=p.group_n_boot,
            seed=p.seed,
            layer=p.analyze_layer,
            head=p.analyze_head,
        )

    def _calibrate(self, kernel: str) -> None:
        from ..fidelity.cli import run_calibrate

        p = self.preset
        base, sink, window = split_sink_window_name(kernel)
        kw: dict[str, Any] = {}
        if base == "oal":
            kw["groups_path"] = self.groups_path
        if kernel in SINK_WINDOW_KERNELS:
            kw["init_from"] = self.calib_dir(base)
            kw["n_sink"] = p.n_sink if sink else None
            kw["window"] = p.window if window else None
        run_calibrate(
            self.model,
            kernel=kernel,
            layers=self.layers,
            out=self.calib_dir(kernel),
            seq_len=p.calib_seq_len,
            data_dir=self.data_dir,
            cache=self.cache,
            train_blocks=list(p.calib_train_blocks),
            val_blocks=list(p.calib_val_blocks),
            seed=p.seed,
            config_overrides=p.calibration_overrides(),
            progress=self.progress,
            **kw,
        )

    def _fidelity(self) -> None:
        from ..fidelity.cli import run_fidelity

        p = self.preset
        run_fidelity(
            self.model,
            methods=["softmax", *(m if m in self.fixed else f"{m}={self.calib_dir(m)}" for m in self._converted())],
            layers=list(p.fidelity_layers),
            blocks=list(p.fidelity_blocks),
            seq_len=p.fidelity_seq_len,
            out=self.out / "fidelity",
            calibrated_root=None,
            data_dir=self.data_dir,
            cache=self.cache,
            seed=p.seed,
            progress=self.progress,
        )

    def convert(self, model: torch.nn.Module, method: str) -> torch.nn.Module:
        """Attach ``method``'s calibrated kernels to the converted layers of a freshly loaded ``model`` with
        :func:`oal.conversion.convert_model` (which checks that the calibration covers exactly these layers and
        records the conversion); parameter-free baselines use their seeded fixed projections."""
        from ..conversion import convert_model

        calibrated = None if method in self.fixed else self.calib_dir(method)
        return convert_model(model, method, layers=self.layers, calibrated=calibrated, seed=self.preset.seed)

    def _finetune(self, method: str) -> None:
        from ..models import load_model, load_tokenizer
        from ..training.cli import run_with_progress

        model, tokenizer = load_model(self.model), load_tokenizer(self.model)
        if method != "softmax":
            self.convert(model, method)
        run_with_progress(
            model, tokenizer, self.preset.finetune_config(), self.finetune_dir(method), data_dir=self.data_dir
        )

    def _evaluate(self, method: str) -> None:
        from ..evaluation import ALL_TASKS, evaluate
        from ..evaluation.utils import default_device
        from ..models import load_model, load_tokenizer
        from ..training import load_finetuned

        p = self.preset
        device = default_device()
        # kernels are rebuilt on the CPU by load_finetuned; the merged model moves as a whole
        model = load_finetuned(load_model(self.model), self.finetune_dir(method), merge=True).to(device).eval()
        result = evaluate(
            model,
            load_tokenizer(self.model),
            ALL_TASKS,
            limit=p.eval_limit,
            block_len=p.eval_block_len,
            max_blocks=p.eval_max_blocks,
            data_dir=self.data_dir,
            batch_size=p.eval_batch_size,
            device=device,
            progress=self.progress,
            model_name=f"{self.model} [{method}]",
        )
        write_json(self.eval_path(method), result)

    def _report(self) -> None:
        from .report import write_report

        write_report(self)


def run_reproduce(
    preset: ReproducePreset,
    *,
    model: str = DEFAULT_MODEL,
    out: str | os.PathLike = DEFAULT_OUT,
    data_dir: str | os.PathLike | None = None,
    cache: str | os.PathLike = DEFAULT_CACHE,
    progress: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the whole pipeline; returns ``reproduce.json``'s content (see :class:`Reproduction`)."""
    return Reproduction(preset, model=model, out=out, data_dir=data_dir, cache=cache, progress=progress).run()
