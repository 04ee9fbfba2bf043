"""Bad input on the command line ends in one ``Error: …`` line and a non-zero exit, never a traceback.

The library reports bad input as ``ValueError("<argument>: expected …, got …")`` (or ``FileNotFoundError``);
:func:`cli_errors` wraps a command so these become click usage errors (exit 2) naming the command-line option
the argument came from, and damaged files (:class:`oal.io.IntegrityError`, training ``CheckpointError``) or
environment problems (``OSError``, a missing optional package) become plain errors (exit 1). The traceback is
logged at DEBUG level: ``oal -v …`` shows it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.models import OptionInfo

from .io import IntegrityError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# library argument names that reach a command under another option name (first existing option wins)
ALIASES: dict[str, tuple[str, ...]] = {
    "name_or_path": ("model",),
    "data_dir": ("data", "data_dir"),
    "block_len": ("seq_len", "block_len"),
    "out_dir": ("out",),
    "n": ("prompts",),
    "length": ("prompt_len",),
}


def command_options(command: Callable[..., Any]) -> dict[str, str]:
    """``{parameter name: its long option}`` of a typer command function (``--name-with-dashes`` by default)."""
    hints = typing.get_type_hints(command, include_extras=True)
    options = {}
    for name, param in inspect.signature(command).parameters.items():
        info = param.default if isinstance(param.default, OptionInfo) else None
        for meta in typing.get_args(hints.get(name)):
            if isinstance(meta, OptionInfo):
                info = meta
        decls = [d for d in (info.param_decls or ()) if d.startswith("--")] if info is not None else []
        options[name] = decls[0] if decls else "--" + name.replace("_", "-")
    return options


def _option_for(message: str, options: dict[str, str]) -> str | None:
    """The option named by the message's leading ``argument:`` (directly or through :data:`ALIASES`)."""
    m = re.match(r"([A-Za-z_]\w*):", message)
    if m is None:
        return None
    for name in (m[1], *ALIASES.get(m[1], ())):
        if name in options:
            return options[name]
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        text = f"{err.strerror}: {err.filename}"
    return text.splitlines()[0] if text else type(err).__name__


def as_cli_error(err: BaseException, options: dict[str, str] | None = None) -> typer.BadParameter | typer.Exit:
    """The typer exception that ends a command on ``err`` with one error line (see the module docstring); for
    exit status 1 the line is printed here."""
    message = _first_line(err)
    damaged = isinstance(err, IntegrityError) or type(err).__name__ == "CheckpointError"
    if not damaged and isinstance(err, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return typer.BadParameter(message, param_hint=_option_for(message, options or {}))
    if not damaged:
        message = f"{type(err).__name__}: {message}"
    typer.echo(f"Error: {message}", err=True)
    return typer.Exit(1)


def _is_user_error(err: BaseException) -> bool:
    return isinstance(err, (ValueError, OSError, ImportError)) or type(err).__name__ == "CheckpointError"


def cli_errors(command: F) -> F:
    """Decorate a typer command so bad input ends in one error line (see the module docstring)."""
    options = command_options(command)

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (typer.BadParameter, typer.Exit, typer.Abort):
            raise
        except Exception as err:
            if not _is_user_error(err):
                raise
            logger.debug("%s failed", getattr(command, "__name__", "command"), exc_info=True)
            raise as_cli_error(err, options) from err

    return wrapper  # type: ignore[return-value]
