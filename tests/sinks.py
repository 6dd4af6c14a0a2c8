"""A results-store stand-in for training tests (importable: tests/ is on sys.path via conftest)."""


class ListSink:
    """Keeps logged rows in memory, per table, with the RunWriter methods the loop calls."""

    def __init__(self):
        self.rows = {}

    def log(self, table, row, dims=None):
        self.rows.setdefault(table, []).append(row)

    def update_attrs(self, **attrs):
        pass

    def flush(self):
        pass

    def column(self, table, name):
        return [r[name] for r in self.rows.get(table, [])]

    def losses(self):
        """(step, loss) of every logged training step: what bit-exact comparisons compare."""
        return [(r["step"], r["loss"]) for r in self.rows["train"]]
