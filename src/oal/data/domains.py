"""Held-out English text beyond WikiText, available offline, for perplexity on other domains.

* ``pydoc``: the Python language reference topics shipped with every CPython (``pydoc_data.topics``),
  technical prose with code. Calibration reads it only when WikiText is absent (a stand-in), so with the shared
  data it is text the conversion never saw.
* ``hellaswag``: each HellaSwag validation item's context followed by its correct ending (ActivityNet / WikiHow
  descriptions of everyday activities), items in file order. The multiple-choice task scores the options; as
  running text it is a different measurement, and neither calibration nor adaptation reads it.
* ``licenses``: the licence texts of ``/usr/share/common-licenses`` (GPL, LGPL, Apache, MPL, GFDL, …), legal
  English, files in name order.

Each is written as a plain text file, so ``oal eval --text FILE`` scores it like WikiText (F.3 blocks).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DOMAINS", "domain_text", "write_domain_texts"]

DOMAINS = ("pydoc", "hellaswag", "licenses")
LICENSES_DIR = Path("/usr/share/common-licenses")


def _hellaswag(data_dir: Path) -> str:
    path = data_dir / "hellaswag" / "hellaswag_val_full.txt"
    if not path.is_file():
        raise FileNotFoundError(f"data_dir: no HellaSwag validation file at {path}")
    lines = path.read_text(encoding="utf-8").split("\n")
    items = []
    for i in range(0, len(lines) - 5, 6):
        context, label, endings = lines[i], lines[i + 1], lines[i + 2 : i + 6]
        if not label.strip().isdigit():
            raise ValueError(f"{path}: line {i + 2} should be the label of an item, got {label!r}")
        items.append(f"{context.strip()} {endings[int(label)].strip()}")
    return "\n\n".join(items)


def domain_text(name: str, *, data_dir: str | os.PathLike | None = None) -> str:
    """The text of domain ``name`` (:data:`DOMAINS`); ``data_dir`` (default ``$OAL_DATA_DIR``) for HellaSwag."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key].strip() for key in sorted(topics))
    if name == "hellaswag":
        root = data_dir if data_dir is not None else os.environ.get("OAL_DATA_DIR")
        if root is None:
            raise ValueError("data_dir: the hellaswag domain needs data_dir or $OAL_DATA_DIR")
        return _hellaswag(Path(root))
    if name == "licenses":
        files = sorted(p for p in LICENSES_DIR.glob("*") if p.is_file() and not p.is_symlink())
        if not files:
            raise FileNotFoundError(f"no licence texts in {LICENSES_DIR}")
        return "\n\n".join(p.read_text(encoding="utf-8", errors="replace").strip() for p in files)
    raise ValueError(f"name: expected one of {DOMAINS}, got {name!r}")


def write_domain_texts(
    out_dir: str | os.PathLike, names: tuple[str, ...] = DOMAINS, *, data_dir: str | os.PathLike | None = None
) -> dict[str, Path]:
    """Write each domain's text to ``out_dir/<name>.txt`` (atomically); returns ``{name: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in names:
        path = out / f"{name}.txt"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(domain_text(name, data_dir=data_dir), encoding="utf-8")
        os.replace(tmp, path)
        paths[name] = path
    return paths
