"""The experiment registry is the one source of runs, consistent with the presets."""
import pytest

from optimus_core import presets
from optimus_core.config import ConfigError
from workflow.experiments import EXPERIMENTS, RunScale, get, pretraining


def test_every_run_resolves_to_a_valid_config():
    for exp in EXPERIMENTS.values():
        for scale in ("laptop", "paper"):
            rs = exp.scale(scale)
            cfg = presets.get(rs.preset).run_config(**rs.overrides())
            assert cfg.train.steps == rs.steps
            assert cfg.tokens_per_step * rs.steps >= rs.tokens


def test_paper_scale_matches_the_study():
    exp = get("pretrain-mula-7b-a1b")
    assert exp.paper.preset == "mula-7b-a1b" and exp.paper.devices == 3072 and exp.paper.nodes == 256
    # the authors' batch: one 2048-token sequence per tile
    assert exp.paper.batch == 3072 and exp.paper.steps == 635_783  # ceil(4e12 / (3072 * 2048))
    assert {e.name for e in pretraining()} >= {"pretrain-mula-1b", "pretrain-mula-7b-a1b"}
    assert exp.run_id("laptop") == "laptop-pretrain-mula-7b-a1b"


def test_bad_registry_entries_fail_early():
    with pytest.raises(ConfigError, match="unknown; known presets"):
        RunScale("mula-3b", 10**9, devices=1)
    with pytest.raises(ConfigError, match="less than one step"):
        RunScale("mula-1b@laptop", 100, devices=1)
    with pytest.raises(ConfigError, match="scale = 'huge'"):
        get("pretrain-mula-1b").scale("huge")
