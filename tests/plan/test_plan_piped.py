"""`xpar plan`'s table written to a pipe or a file (xpar.plan.show.print_plan)."""


def test_plan_piped_to_a_file_keeps_its_title_and_last_column(capsys):
    """`xpar plan ... > file` (rich's console not a terminal) cut the title and the last column."""
    from tests.plan.test_plan import plan_of
    from xpar.plan.show import print_plan, ranked_table

    plan = plan_of("model=70b", "hardware=h100_80gb_64gpu")
    title = str(ranked_table(plan).title)
    print_plan(plan, "python -m xpar ...")
    out = capsys.readouterr().out
    assert len(title) > 200 and title in out, out[:600]
    header = next(line for line in out.splitlines() if "┃  # ┃" in line)
    assert header.rstrip().endswith("┃") and "separates it from" in header, header
