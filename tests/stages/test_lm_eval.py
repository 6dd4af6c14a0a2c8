"""lm-evaluation-harness adapter: our model's scores through the real lm-eval machinery, offline.

The adapter's numbers are checked against direct computations with our model (log-softmax sums,
greedy argmax), and the harness's accuracy on the offline continuation tasks against the same
accuracy recomputed here from the task files.
"""
import json

import pytest
import torch

pytest.importorskip("lm_eval")

from optimus_core.eval.lm import OptimusLM  # noqa: E402
from optimus_core.eval.tasks import TaskFileError, build_continuation_tasks, run_lm_eval  # noqa: E402
from workflow.cli import main  # noqa: E402


class Req:  # the one attribute of lm_eval's Instance the model reads
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokens_dir):
    run_dir = tmp_path_factory.mktemp("lmeval") / "run"
    assert main(["pretrain", "--preset", "mula-1b@laptop", "--data", str(tokens_dir), "--out", str(run_dir),
                 "--steps", "2", "--quiet", "--set", "train.eval_batches=1"]) == 0
    return run_dir


@pytest.fixture(scope="module")
def lm(run_dir):
    return OptimusLM.from_run(run_dir, batch_size=4)


def direct_logprob(lm, ctx, cont):
    with torch.no_grad():
        logits = lm.model(torch.tensor([ctx + cont[:-1]]))[0, :, :lm.vocab_size].float()
    logp = logits.log_softmax(-1)[len(ctx) - 1:]
    return logp.gather(1, torch.tensor(cont)[:, None]).sum().item(), bool((logp.argmax(-1) == torch.tensor(cont)).all())


def test_loglikelihood_matches_a_direct_forward(lm):
    context, continuation = "def add(a, b):\n    return", " a + b\n"
    (got, greedy), = lm.loglikelihood([Req(context, continuation)])
    ctx, cont = lm._encode_pair(context, continuation)
    assert lm.tok_decode(ctx + cont) == context + continuation
    want, want_greedy = direct_logprob(lm, ctx, cont)
    assert got == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    # batching and ordering do not change a request's score
    many = lm.loglikelihood([Req("x = 1", " + 2"), Req(context, continuation), Req("", "hello")])
    assert many[1][0] == pytest.approx(got, abs=1e-4)
    assert many[2][0] == pytest.approx(direct_logprob(lm, [lm.eos_id], lm.tok_encode("hello"))[0], abs=1e-4)


def test_loglikelihood_rolling_scores_every_token_once(lm):
    short = "The quick brown fox jumps over the lazy dog."
    tokens = lm.tok_encode(short)
    (got,) = lm.loglikelihood_rolling([Req(short)])
    assert got == pytest.approx(direct_logprob(lm, [lm.eos_id], tokens)[0], abs=1e-4)
    long = short * 60  # longer than the model's context (128): several windows
    assert len(lm.tok_encode(long)) > lm.max_length
    (got_long,) = lm.loglikelihood_rolling([Req(long)])
    assert got_long < got < 0


def test_generate_until_is_greedy_and_stops(lm):
    context = "import os\n"
    (free,) = lm.generate_until([Req(context, {"until": [], "max_gen_toks": 6})])
    tokens = lm.tok_encode(context)
    new = []
    with torch.no_grad():
        for _ in range(6):
            nxt = int(lm.model(torch.tensor([tokens + new]))[0, -1, :lm.vocab_size].argmax())
            if nxt == lm.eos_id:
                break
            new.append(nxt)
    assert free == lm.tok_decode(new)
    if len(free) > 1:  # stopping at a string cuts the answer before it
        stop = free[len(free) // 2:]
        (cut,) = lm.generate_until([Req(context, {"until": [stop], "max_gen_toks": 6})])
        assert cut == free.split(stop)[0]


def test_evaluate_runs_continuation_tasks_through_lm_eval(run_dir, tokens_dir, tmp_path, capsys):
    store, out = tmp_path / "store.zarr", tmp_path / "eval.json"
    code = main(["evaluate", "--run", str(run_dir), "--tasks", "heldout", "continuation", "--items", "24",
                 "--max-batches", "1", "--store", str(store), "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    manifest = json.loads((tokens_dir / "manifest.json").read_text())
    tasks = sorted(doc["downstream"])
    assert tasks == sorted(f"optimus_cont_{s}" for s in manifest["sources"])
    assert "loss" in doc  # the held-out metrics are still there

    # The harness's accuracy equals the accuracy recomputed here from the same (deterministic) items.
    names = build_continuation_tasks(tokens_dir, tmp_path / "tasks", n_items=24)
    lm = OptimusLM.from_run(run_dir)
    for name in names:
        items = [json.loads(line) for line in (tmp_path / "tasks" / f"{name}.jsonl").read_text().splitlines()]
        assert all(len(it["choices"]) == 4 and 0 <= it["label"] < 4 for it in items)
        scores = lm.loglikelihood([Req(it["context"], c) for it in items for c in it["choices"]])
        right = sum(max(range(4), key=lambda j: scores[4 * i + j][0]) == it["label"] for i, it in enumerate(items))
        assert doc["downstream"][name]["n"] == len(items)
        assert doc["downstream"][name]["acc"] == pytest.approx(right / len(items))

    from optimus_core.store import open_store
    table = open_store(store, mode="r").metrics(doc["run_id"], "downstream")
    assert len(table) == 1 and table["acc." + tasks[0]].iloc[0] == pytest.approx(doc["downstream"][tasks[0]]["acc"])


def test_bad_task_files_and_names_give_clear_errors(lm, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: x\n  dataset_path: [unclosed\n")
    with pytest.raises(TaskFileError, match="broken.yaml: not valid YAML"):
        run_lm_eval(lm, ["x"], task_dirs=[bad])
    (bad / "broken.yaml").write_text("- just\n- a list\n")
    with pytest.raises(TaskFileError, match="broken.yaml: not an lm-eval task definition"):
        run_lm_eval(lm, ["x"], task_dirs=[bad])
    (bad / "broken.yaml").unlink()
    with pytest.raises(ValueError, match=r"tasks = \['no_such_task'\]: unknown to lm-eval"):
        run_lm_eval(lm, ["no_such_task"], task_dirs=[bad], include_defaults=False)
