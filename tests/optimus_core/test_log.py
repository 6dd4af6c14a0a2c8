"""optimus_core.log: one line a record with the rank in front, rank 0 from INFO up and the
others from WARNING up, warnings through the same lines, and a second setup replacing the first;
``quiet``: warnings only, on every rank."""
import logging
import warnings

import pytest

from optimus_core.log import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_logging():
    root, py_warnings = logging.getLogger("optimus"), logging.getLogger("py.warnings")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (root, py_warnings)]
    yield
    logging.captureWarnings(False)
    for lg, handlers, level, propagate in saved:
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def test_module_names_map_into_one_tree():
    assert get_logger("optimus_core.train.loop").name == "optimus.train.loop"
    assert get_logger("stages.rehearse").name == "optimus.stages.rehearse"
    assert get_logger("optimus_core").name == "optimus"


def test_a_multi_rank_line_names_its_rank(capsys):
    configure_logging(rank=3, world=8)
    log = get_logger("optimus_core.train.loop")
    log.info("the plan")  # not rank 0: INFO is not news from 8 ranks
    log.warning("loss spike at step %d", 7)
    assert capsys.readouterr().err.splitlines() == ["[optimus 3/8] loss spike at step 7"]


def test_rank_zero_logs_info_and_debug_logs_everything(capsys):
    configure_logging(rank=0, world=2)
    get_logger("stages.scaling").info("point done")
    get_logger("stages.scaling").debug("detail")
    assert capsys.readouterr().err.splitlines() == ["[optimus 0/2] point done"]
    configure_logging(rank=1, world=2, debug=True)  # replaces the setup: one line per record, not two
    get_logger("stages.scaling").debug("detail")
    assert capsys.readouterr().err.splitlines() == ["[optimus 1/2] detail"]


def test_one_process_has_no_rank_and_warnings_share_the_lines(capsys):
    configure_logging()
    warnings.warn("skipping checkpoint: torn meta.json", stacklevel=1)
    err = capsys.readouterr().err
    assert err.startswith("[optimus] ") and "skipping checkpoint: torn meta.json" in err


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 4 of world 4"):
        configure_logging(rank=4, world=4)


def test_quiet_keeps_only_warnings_on_rank_zero_too(capsys):
    configure_logging(rank=0, world=1, quiet=True)
    get_logger("optimus_core.train.loop").info("execution plan ...")
    get_logger("optimus_core.train.loop").warning("took over a stale lock")
    assert capsys.readouterr().err.splitlines() == ["[optimus] took over a stale lock"]
