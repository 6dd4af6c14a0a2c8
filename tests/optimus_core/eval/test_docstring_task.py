"""The offline docstring task: items read from held-out code are well-formed, true and deterministic."""
import json

import pytest
import yaml

from optimus_core.eval.docstring import (TASK_NAME, build_docstring_task, docstring_items, documented_functions,
                                         heldout_documents)

SOURCE = '''"""Module docstring: not a function's."""
import functools


def plain(a, b=2):
    """Add two numbers and return the sum."""
    return a + b


@functools.lru_cache
@staticmethod
def decorated(x):
    r"""Cache the square of x (a raw docstring).

    More text that is not the summary.
    """
    return x * x


class Box:
    """A class docstring: classes are not items."""

    def method(self):
        """
        Return the box itself, summary on the second line.
        """
        def inner():
            \'\'\'Nested helper with single quotes.\'\'\'
        return self

    def short(self):
        """Tiny."""

    def undocumented(self):
        return 1
'''


def test_documented_functions_cut_context_at_the_summary():
    found = list(documented_functions(SOURCE))
    assert [q for q, _, _ in found] == ["plain", "decorated", "Box.method", "Box.method.inner"]
    by_name = {q: (context, summary) for q, context, summary in found}
    assert by_name["plain"] == ('def plain(a, b=2):\n    """', "Add two numbers and return the sum.")
    # decorators belong to the context; a raw prefix is part of the opening quotes
    assert by_name["decorated"] == ('@functools.lru_cache\n@staticmethod\ndef decorated(x):\n    r"""',
                                    "Cache the square of x (a raw docstring).")
    # a summary on the line after the quotes: the newline and indentation are context
    assert by_name["Box.method"] == ('    def method(self):\n        """\n        ',
                                     "Return the box itself, summary on the second line.")
    assert by_name["Box.method.inner"] == ("        def inner():\n            '''", "Nested helper with single quotes.")
    for context, summary in by_name.values():  # the context is the source up to the summary
        assert context + summary in SOURCE
    assert list(documented_functions("def broken(:\n")) == []


def test_items_from_held_out_code_are_well_formed_true_and_deterministic(code_tokens_dir):
    docs = dict(heldout_documents(code_tokens_dir))
    found = [(f"{doc_id}:{q}", context, summary) for doc_id, text in docs.items()
             for q, context, summary in documented_functions(text)]
    truth = {ident: (context, summary) for ident, context, summary in found}
    assert len(truth) == len(found) >= 8, "the test corpus should hold documented held-out functions"
    items = docstring_items(code_tokens_dir, n_items=500)
    assert [item["id"] for item in items] == [ident for ident, _, _ in found]  # each once, none invented
    for item in items:
        context, summary = truth[item["id"]]
        assert item["context"] == context and len(item["choices"]) == 4
        assert 0 <= item["label"] < 4 and item["choices"][item["label"]] == summary
        assert len(set(item["choices"])) == 4  # no duplicate choices, so the truth appears once
        assert all(c.strip() and "\n" not in c for c in item["choices"])
    # the true answer sits at every position somewhere (seeded), not always the same one
    assert len({item["label"] for item in items}) > 1
    assert docstring_items(code_tokens_dir, n_items=500) == items  # deterministic
    other = docstring_items(code_tokens_dir, n_items=500, seed=1)
    assert [i["id"] for i in other] == [i["id"] for i in items] and other != items
    assert docstring_items(code_tokens_dir, n_items=3) == items[:3]
    assert docstring_items(code_tokens_dir, n_choices=len(items) + 99) == []  # too few: none, never padded


def test_build_writes_an_lm_eval_task(code_tokens_dir, tmp_path):
    assert build_docstring_task(code_tokens_dir, tmp_path, n_items=5) == TASK_NAME
    spec = yaml.safe_load((tmp_path / f"{TASK_NAME}.yaml").read_text())
    assert spec["task"] == TASK_NAME and spec["output_type"] == "multiple_choice"
    assert spec["target_delimiter"] == "" and spec["doc_to_choice"] == "choices"
    rows = [json.loads(line) for line in (tmp_path / f"{TASK_NAME}.jsonl").read_text().splitlines()]
    assert rows == docstring_items(code_tokens_dir, n_items=5)
    with pytest.raises(ValueError, match="source = 'nope': not in the data"):
        build_docstring_task(code_tokens_dir, tmp_path, source="nope")
    with pytest.raises(ValueError, match="fewer than 1000 Python functions"):
        build_docstring_task(code_tokens_dir, tmp_path, n_choices=1000)
