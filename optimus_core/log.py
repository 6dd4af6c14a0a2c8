"""The standard library's logging for every rank: one line a record, the rank in front of it.

    from optimus_core.log import get_logger, configure_logging
    log = get_logger(__name__)          # "optimus.<module>": one tree, configured in one place
    configure_logging(rank=3, world=8)  # the CLI, once it knows the rank
    log.warning("loss spike")           # -> "[optimus 3/8] loss spike" on stderr

Contract: records go to stderr through ``tqdm.write`` (a progress bar on the same terminal is
redrawn below them, not torn). In a multi-rank run rank 0 logs from INFO up and every other rank
from WARNING up (12288 copies of the plan help nobody; any rank's warning is news); ``debug=True``
logs everything on every rank. ``warnings.warn`` goes through the same handler, so a warning names
its rank too. Until ``configure_logging`` is called the library adds no handler: a program that
imports the core keeps its own logging setup.
"""
from __future__ import annotations

import logging
import sys

ROOT = "optimus"


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001  (logging's contract: a failed emit reports, never raises)
            self.handleError(record)


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name``: ``optimus_core.train.loop`` -> ``optimus.train.loop``,
    ``stages.rehearse`` -> ``optimus.stages.rehearse``."""
    short = name.removeprefix("optimus_core").strip(".")
    return logging.getLogger(f"{ROOT}.{short}" if short else ROOT)


def configure_logging(rank: int = 0, world: int = 1, *, debug: bool = False, quiet: bool = False) -> logging.Logger:
    """Send the ``optimus`` loggers (and ``warnings``) to stderr with this rank's prefix; calling
    it again (a spawned rank, a later phase) replaces the previous setup rather than adding to it.
    ``quiet``: every rank from WARNING up (no plan, no progress lines: what is wrong, only)."""
    if not 0 <= rank < max(world, 1):
        raise ValueError(f"rank {rank} of world {world}: expected 0 <= rank < world")
    prefix = f"[{ROOT} {rank}/{world}]" if world > 1 else f"[{ROOT}]"
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    root = logging.getLogger(ROOT)
    for old in [h for h in root.handlers if isinstance(h, _TqdmHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.propagate = False
    root.setLevel(logging.DEBUG if debug else logging.INFO if rank == 0 and not quiet else logging.WARNING)
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    for old in [h for h in warnings_logger.handlers if isinstance(h, _TqdmHandler)]:
        warnings_logger.removeHandler(old)
    warnings_logger.addHandler(handler)
    warnings_logger.propagate = False
    return root
