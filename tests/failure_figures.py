"""The figures the failure tests measure — failures injected, rows lost, rows duplicated, share of finished rows
recomputed on resume — and the measurements other tests print (`note`), collected while they run and printed at the
end of the session, so every CI log carries them (the README's failure-model figures quote such a run). Each test
still asserts lost = duplicated = 0 itself.

A test records into its own process; tests/conftest.py moves what was recorded onto the test's report (its
`user_properties`), and the session prints what the reports carried. Reports are what pytest-xdist sends from its
worker processes to the one that prints, so the figures reach the log whether the tests ran in one process or many.
"""

from __future__ import annotations

# Recorded in this process and not yet moved onto a report.
PENDING: list[tuple[str, object]] = []
FIGURE = "failure_figure"
NOTE = "measured"


def record(
    failure: str,
    *,
    injected: int,
    input_lines: int,
    output_ids: list[str | None],
    finished_before: int | None = None,
    recomputed: int | None = None,
) -> None:
    """One failure test's outcome. `output_ids`: the custom_id of every output line (None for lines without one)."""
    named = [i for i in output_ids if i is not None]
    duplicated = len(named) - len(set(named))
    PENDING.append(
        (
            FIGURE,
            {
                "failure": failure,
                "injected": injected,
                "input_lines": input_lines,
                "lost": max(0, input_lines - (len(output_ids) - duplicated)),
                "duplicated": duplicated,
                "recomputed": None if finished_before is None else f"{recomputed or 0}/{finished_before}",
            },
        )
    )


def note(text: str) -> None:
    """A measurement a test reports (a latency, a time to first batch): printed at the end of the session."""
    PENDING.append((NOTE, text))


def take_pending() -> list[tuple[str, object]]:
    """What was recorded since the last call, as `user_properties` entries of a report."""
    taken = list(PENDING)
    PENDING.clear()
    return taken


def figure_lines(figures: list[dict]) -> list[str]:
    header = f"{'failure':<56} {'injected':>8} {'lines':>6} {'lost':>5} {'dup':>4}  recomputed on resume"
    rows = [
        f"{f['failure']:<56} {f['injected']:>8} {f['input_lines']:>6} {f['lost']:>5} {f['duplicated']:>4}  "
        f"{f['recomputed'] or '-'}"
        for f in figures
    ]
    return [header, *rows]
