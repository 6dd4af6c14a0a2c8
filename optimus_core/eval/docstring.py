"""The offline "docstring" task: pick a held-out Python function's docstring among four.

    name = build_docstring_task("results/data/tokens", "/tmp/tasks", n_items=200)
    # -> "optimus_docstring": /tmp/tasks/optimus_docstring.yaml over optimus_docstring.jsonl
    items = docstring_items("results/data/tokens")   # [{"context", "choices", "label", "id"}]

Items come from the val split of the ``code`` source (documents the model never trained on),
decoded from their tokens, so the task is built from the tokenize output alone, like the
continuation tasks. Every function (and method) with a docstring whose source parses gives one
item:

    context   the function's own source from its first line (decorator or ``def``) up to the
              first character of its docstring: signature, opening quotes, and for a docstring
              that starts on the next line the newline and indentation
    choices   the docstring's first line (its summary) and the summaries of ``n_choices - 1``
              other held-out functions, all distinct; the true one at a seeded position

The context holds no other function's code, so no candidate summary can be copied from it.
Chance is ``1 / n_choices``. Items are deterministic in (data, seed), in document order; there
are as many as the held-out code has documented functions (up to ``n_items``), never padded.
The training split's ``docs`` source holds standard-library docstrings without their code, so
a summary may have been seen in training; that favours no choice over another on average.
"""
from __future__ import annotations

import ast
import json
import random
import re
import warnings
from pathlib import Path
from typing import Iterator

TASK_NAME = "optimus_docstring"
# The opening of a string literal: optional prefix letters, then the quotes.
_OPENING = re.compile(r"[rRuUbBfF]{0,2}(\"\"\"|'''|\"|')")
_BLANK = re.compile(r"[ \t\n]*")
_MIN_SUMMARY_CHARS = 8  # shorter first lines ("XXX", "Todo") say nothing about the function


def heldout_documents(data_dir, source: str = "code") -> Iterator[tuple[str, str]]:
    """``(document id, text)`` of every val-split document of ``source``, decoded from its tokens."""
    from tokenizers import Tokenizer

    from optimus_core.data import load_manifest
    from optimus_core.data.shards import open_tokens, read_index

    manifest = load_manifest(data_dir)
    if source not in manifest.sources:
        raise ValueError(f"source = {source!r}: not in the data {data_dir} (sources: "
                         f"{', '.join(manifest.sources)}); the docstring task needs Python code")
    tok = Tokenizer.from_file(str(Path(data_dir) / "tokenizer.json"))
    for f in manifest.files_for("val", [source]):
        tokens = open_tokens(manifest.root / f.tokens, manifest.dtype)
        for row in read_index(manifest.root / f.index):
            ids = tokens[row.start:row.end].tolist()
            if ids and ids[-1] == manifest.eos_id:
                ids = ids[:-1]
            yield row.id, tok.decode(ids, skip_special_tokens=False)


def documented_functions(text: str) -> Iterator[tuple[str, str, str]]:
    """``(qualified name, context, summary)`` per function of ``text`` whose docstring has a
    usable first line, in source order. Text that does not parse yields nothing."""
    try:
        with warnings.catch_warnings():  # invalid escapes in old modules are not our concern
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines(keepends=True)
    line_start = [0]
    for line in lines:
        line_start.append(line_start[-1] + len(line))

    def offset(lineno: int, col_utf8: int) -> int:  # ast columns count UTF-8 bytes
        return line_start[lineno - 1] + len(lines[lineno - 1].encode("utf-8")[:col_utf8].decode("utf-8", "replace"))

    for qualname, node in _functions(tree, ""):
        if not node.body or not isinstance(node.body[0], ast.Expr):
            continue
        literal = node.body[0].value
        if not (isinstance(literal, ast.Constant) and isinstance(literal.value, str)):
            continue
        start = offset(literal.lineno, literal.col_offset)
        opening = _OPENING.match(text, start)
        if opening is None:  # an implicitly concatenated or otherwise unusual literal
            continue
        quote = opening.group(1)
        body_start = opening.end()
        first = _BLANK.match(text, body_start).end()
        end_line = text.find("\n", first)
        end_quote = text.find(quote, first)
        ends = [e for e in (end_line, end_quote) if e >= 0]
        summary = text[first:min(ends)].rstrip() if ends else ""
        if len(summary) < _MIN_SUMMARY_CHARS or summary.startswith("\\") or end_quote < 0:
            continue
        first_line = min([node.lineno] + [d.lineno for d in node.decorator_list])
        yield qualname, text[line_start[first_line - 1]:first], summary


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        elif not isinstance(child, ast.expr):  # if / try / with blocks hold definitions too
            yield from _functions(child, prefix)


def docstring_items(data_dir, *, source: str = "code", n_items: int = 200, n_choices: int = 4,
                    seed: int = 0) -> list[dict]:
    """``[{"id", "context", "choices", "label"}]``: up to ``n_items`` items, in document order;
    ``[]`` when the held-out code has fewer than ``n_choices`` distinct summaries."""
    if n_choices < 2:
        raise ValueError(f"n_choices = {n_choices}: must be >= 2")
    found = [(f"{doc_id}:{qualname}", context, summary)
             for doc_id, text in heldout_documents(data_dir, source)
             for qualname, context, summary in documented_functions(text)]
    # Distractors come from every documented function, items are the first n_items: a smaller
    # n_items gives a prefix of the same items.
    pool = sorted(dict.fromkeys(summary for _, _, summary in found))  # distinct, in a fixed order
    if len(pool) < n_choices:
        return []
    rng = random.Random(f"{seed}:docstring")
    items = []
    for ident, context, summary in found[:n_items]:
        others = rng.sample([s for s in pool if s != summary], n_choices - 1)
        label = rng.randrange(n_choices)
        items.append({"id": ident, "context": context, "choices": others[:label] + [summary] + others[label:],
                      "label": label})
    return items


def build_docstring_task(data_dir, out_dir, *, source: str = "code", n_items: int = 200, n_choices: int = 4,
                         seed: int = 0) -> str:
    """Write the task (YAML + JSONL) into ``out_dir``; its name. ValueError when the held-out code
    has too few documented functions for one item."""
    import yaml

    from optimus_core.atomic import atomic_write

    from .tasks import task_yaml

    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if not (data_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{data_dir}/tokenizer.json: missing; the docstring task needs a tokenize output")
    items = docstring_items(data_dir, source=source, n_items=n_items, n_choices=n_choices, seed=seed)
    if not items:
        raise ValueError(f"{data_dir}: the val split of {source!r} holds fewer than {n_choices} Python functions "
                         "with distinct docstring summaries; the docstring task needs more held-out code")
    out_dir.mkdir(parents=True, exist_ok=True)
    data_file = out_dir / f"{TASK_NAME}.jsonl"
    atomic_write(data_file, "".join(json.dumps(it) + "\n" for it in items))
    atomic_write(out_dir / f"{TASK_NAME}.yaml", yaml.safe_dump(task_yaml(TASK_NAME, data_file), sort_keys=False))
    return TASK_NAME
