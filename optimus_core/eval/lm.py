"""Our model as an lm-evaluation-harness model: loglikelihood, rolling loglikelihood, greedy generation.

    from optimus_core.eval.lm import OptimusLM
    lm = OptimusLM.from_run("results/runs/x", batch_size=16)
    lm.loglikelihood_tokens([([0, 17, 42], [99, 7])])      # [(sum log p(99, 7 | ...), is_greedy)]
    # or: lm_eval.simple_evaluate(model=lm, tasks=[...]); once this module is imported the
    # class is also lm-eval's model "optimus": simple_evaluate(model="optimus",
    # model_args="run_dir=results/runs/x", tasks=[...])

Log-probabilities are over the tokenizer's vocabulary: the embedding's padding rows (vocab padded
to a multiple of 128) are never targets, so they are cut off before the softmax rather than
allowed to take probability mass. Requests are scored in float32, no KV cache: our models are
small and the harness's multiple-choice tasks need one forward per (context, choice) anyway.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tokenizers import Tokenizer


@register_model("optimus")
class OptimusLM(LM):
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, eos_id: int, vocab_size: int,
                 max_length: int, batch_size: int = 16, max_gen_toks: int = 64, device: str = "cpu",
                 run_dir: Optional[str] = None):
        super().__init__()
        self.model, self.tokenizer = model.eval().to(device), tokenizer  # noqa: the harness's LM has a read-only `device`
        self.eos_id, self.vocab_size, self.max_length = eos_id, vocab_size, max_length
        self.batch_size, self.max_gen_toks, self._device = int(batch_size), int(max_gen_toks), torch.device(device)
        self.run_dir = run_dir

    @classmethod
    def from_run(cls, run_dir, data_dir=None, **kwargs) -> "OptimusLM":
        """The newest checkpoint of ``run_dir`` with the tokenizer of its data (or ``data_dir``)."""
        from optimus_core import load_model

        model, cfg = load_model(run_dir)
        return cls.for_model(model, cfg, data_dir, run_dir=str(run_dir), **kwargs)

    @classmethod
    def for_model(cls, model, cfg, data_dir=None, **kwargs) -> "OptimusLM":
        """An already loaded ``(model, RunConfig)``; the tokenizer from ``data_dir`` or the run's data."""
        from optimus_core.data import load_manifest

        data_dir = Path(data_dir or cfg.data.path)
        tok_path = data_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"{tok_path}: missing; lm-eval needs the run's tokenizer (pass the "
                                    "`optimus tokenize` output the run used)")
        manifest = load_manifest(data_dir)
        return cls(model, Tokenizer.from_file(str(tok_path)), eos_id=manifest.eos_id, vocab_size=cfg.model.vocab_size,
                   max_length=min(cfg.model.max_seq_len, cfg.data.seq_len), **kwargs)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "OptimusLM":
        """``lm_eval --model optimus --model_args run_dir=DIR[,data_dir=DIR][,batch_size=N]``."""
        args = lm_utils.simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if k == "batch_size" and v is not None}
        return cls.from_run(**{**args, **extra})

    # ------------------------------------------------------------------------- tokens

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tok_decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def tokenizer_name(self) -> str:
        return f"optimus:{self.run_dir}"

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # As the harness's HF model: trailing spaces of the context belong to the continuation
        # (BPE merges " word"), and the continuation is what the joint encoding adds.
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
        return (ctx, whole[len(ctx):]) if ctx == whole[:len(ctx)] else (ctx, self.tok_encode(continuation))

    # ------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def _logprobs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """log_softmax over the real vocabulary for each (unpadded) input, (len, vocab) float32."""
        longest = max(len(x) for x in inputs)
        batch = torch.full((len(inputs), longest), self.eos_id, dtype=torch.long)
        for i, x in enumerate(inputs):  # right padding: causal attention never sees it
            batch[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        logits = self.model(batch.to(self._device)).float()[..., :self.vocab_size]
        logp = F.log_softmax(logits, dim=-1).cpu()
        return [logp[i, :len(x)] for i, x in enumerate(inputs)]

    def loglikelihood_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy choice) per token pair."""
        out: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        cut = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("loglikelihood: empty continuation")
            ctx = ctx or [self.eos_id]  # an empty context is conditioned on a document start
            full = (ctx + cont)[-(self.max_length + 1):]  # keep the continuation, drop old context
            cut.append((full[:-1], min(len(cont), self.max_length)))  # a longer one is scored in part
        order = sorted(range(len(pairs)), key=lambda i: -len(cut[i][0]))  # similar lengths batch together
        for lo in range(0, len(order), self.batch_size):
            idx = order[lo:lo + self.batch_size]
            logps = self._logprobs([cut[i][0] for i in idx])
            for i, logp in zip(idx, logps):
                n = cut[i][1]
                target = torch.tensor(pairs[i][1][-n:])
                rows = logp[-n:]
                score = rows.gather(1, target[:, None]).sum().item()
                out[i] = (score, bool((rows.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self._encode_pair(*r.args[:2]) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-string log-likelihood: disjoint windows of max_length, each with maximal context."""
        scores = []
        for r in requests:
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                self.tok_encode(r.args[0]), prefix_token=self.eos_id, max_seq_len=self.max_length, context_len=1)]
            scores.append(sum(s for s, _ in self.loglikelihood_tokens(windows)))
        return scores

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        """Greedy decoding until a stop string, EOS or ``max_gen_toks`` new tokens."""
        outputs = []
        for r in requests:
            context, kwargs = r.args[0], dict(r.args[1] or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            tokens, new = self.tok_encode(context) or [self.eos_id], []
            text = ""
            for _ in range(max_new):
                window = (tokens + new)[-self.max_length:]
                logits = self.model(torch.tensor([window], device=self._device))[0, -1, :self.vocab_size]
                nxt = int(logits.argmax())
                if nxt == self.eos_id:
                    break
                new.append(nxt)
                text = self.tok_decode(new)
                if any(s in text for s in until):
                    break
            for s in until:  # the answer ends before the first stop string
                text = text.split(s)[0]
            outputs.append(text)
        return outputs
