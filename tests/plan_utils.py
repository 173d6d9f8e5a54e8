"""The planner's CLI run in this process, shared by the tests/test_plan_*.py files."""
from pyfast.plan import cli


def plan(argv, capsys):
    """(exit code, stdout, stderr) of `pyfast plan ARGV` in this process."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err
