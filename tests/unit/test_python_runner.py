"""The python family's interpreter: the runner's report and the tool message made from it (pure), and the runner
program itself, run here as a plain local process (the sandboxed runs are in tests/integration/test_python_env.py)."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import pytest

from env_workers.envs import python_runner
from env_workers.envs.python_runner import Report, parse_report, tool_text
from env_workers.sandbox.base import TRUNCATION_NOTE

LIMIT, KEEP = 800, 780  # the os family's (AgentBench's) cut


def _report_line(**fields: object) -> str:
    raw = {"exit": 0, "timed_out": False, "spawn_error": None, "stdout": "", "stdout_bytes": 0, "stderr": "",
           **fields}
    return "\n" + python_runner.REPORT_MARK + json.dumps(raw) + "\n"


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _run_locally(code: str, timeout_s: float = 5.0, output_limit: int = LIMIT) -> Report:
    argv = python_runner.runner_argv(code, output_limit, timeout_s)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 10)
    report = parse_report(done.stdout)
    assert report is not None, done.stdout + done.stderr
    return report


def test_the_report_is_read_from_the_last_marked_line() -> None:
    output = ("noise\n" + _report_line(exit=1, stdout=_b64("early"), stdout_bytes=5)
              + "more noise" + _report_line(exit=0, stdout=_b64("42\n"), stdout_bytes=3, stderr=_b64("warn")))
    assert parse_report(output) == Report(0, False, "42\n", False, "warn")


@pytest.mark.parametrize("output", [
    "", "Traceback (most recent call last):\nKilled\n", python_runner.REPORT_MARK + "{not json",
    _report_line(exit="0"), _report_line(timed_out=1), _report_line(stdout="!!not base64!!"),
    _report_line(stdout_bytes=None), _report_line(spawn_error=3), python_runner.REPORT_MARK + '{"exit": 0}',
    python_runner.REPORT_MARK + "[1, 2]",
])
def test_a_missing_or_malformed_report_is_none_not_an_exception(output: str) -> None:
    assert parse_report(output) is None


def test_undecodable_output_bytes_become_replacement_characters() -> None:
    report = parse_report(_report_line(stdout=_b64(b"ok \xff\xfe done"), stdout_bytes=10))
    assert report is not None and report.stdout == "ok \ufffd\ufffd done" and not report.stdout_cut


def test_stdout_is_shown_as_printed_and_an_empty_one_says_so() -> None:
    assert tool_text(Report(0, False, "42\n", False, ""), 10, LIMIT, KEEP) == "42\n"
    assert tool_text(Report(0, False, "", False, "a warning"), 10, LIMIT, KEEP) == python_runner.EMPTY_OUTPUT


def test_a_failing_program_shows_its_output_then_only_the_last_line_of_the_traceback() -> None:
    traceback = ('Traceback (most recent call last):\n  File "<stdin>", line 2, in <module>\n'
                 'ZeroDivisionError: division by zero\n\n')
    text = tool_text(Report(1, False, "step 1\n", False, traceback), 10, LIMIT, KEEP)
    assert text == "step 1\nZeroDivisionError: division by zero"
    assert tool_text(Report(1, False, "no newline", False, traceback), 10, LIMIT, KEEP).endswith(
        "no newline\nZeroDivisionError: division by zero")
    assert tool_text(Report(3, False, "", False, ""), 10, LIMIT, KEEP) == "Error: the code exited with status 3"


def test_long_output_is_cut_as_the_os_family_cuts_shell_output() -> None:
    text = tool_text(Report(0, False, "x" * 5000, True, ""), 10, LIMIT, KEEP)
    assert text == "x" * KEEP + TRUNCATION_NOTE
    # Cut by the runner below the text limit (a small byte budget): the note is still there.
    assert tool_text(Report(0, False, "y" * 100, True, ""), 10, LIMIT, KEEP) == "y" * 100 + TRUNCATION_NOTE
    # The error line survives any amount of output, and is itself cut.
    text = tool_text(Report(1, False, "x" * 5000, True, "ValueError: " + "v" * 5000), 10, LIMIT, KEEP)
    assert text.count(TRUNCATION_NOTE) == 2 and "\nValueError: vvv" in text
    assert len(text) == 2 * (KEEP + len(TRUNCATION_NOTE)) + 1


def test_time_limit_signals_and_a_failed_start_each_have_their_own_line() -> None:
    assert tool_text(Report(-9, True, "", False, ""), 2.5, LIMIT, KEEP) == \
        "TimeoutError: the code ran past the limit of 2.5 s and was stopped"
    assert "killed by SIGKILL" in tool_text(Report(-9, False, "", False, ""), 2, LIMIT, KEEP)
    assert "killed by SIGXCPU" in tool_text(Report(-24, False, "", False, ""), 2, LIMIT, KEEP)
    assert "could not start" in tool_text(Report(None, False, "", False, "", "OSError(11)"), 2, LIMIT, KEEP)
    assert not Report(-9, False, "", False, "").succeeded and not Report(0, True, "", False, "").succeeded
    assert Report(0, False, "", False, "").succeeded
    assert "sandbox was reset" in python_runner.lost_text(False, 2) and "2 s" in python_runner.lost_text(True, 2)


def test_the_runner_kept_stdout_allows_the_text_cut_and_stays_under_the_sandboxs_output_cap() -> None:
    assert python_runner.stdout_keep_bytes(800) == 4 * 801
    assert python_runner.stdout_keep_bytes(10**9) == 16 * 1024


def test_code_over_the_argument_budget_is_too_long() -> None:
    assert not python_runner.code_too_long("x" * python_runner.MAX_CODE_BYTES)
    assert python_runner.code_too_long("é" * (python_runner.MAX_CODE_BYTES // 2 + 1))


def test_the_runner_reports_stdout_and_stderr_apart_and_the_exit_status() -> None:
    report = _run_locally("import sys\nprint('out')\nprint('err', file=sys.stderr)\nraise KeyError('k')")
    assert report.stdout == "out\n" and report.exit_code == 1 and report.stderr.endswith("KeyError: 'k'\n")
    assert "err" in report.stderr and not report.succeeded
    assert _run_locally("print(6 * 7)") == Report(0, False, "42\n", False, "")


def test_the_runner_stops_a_program_at_its_time_limit_with_what_it_printed() -> None:
    report = _run_locally("import time\nprint('started', flush=True)\nwhile True: time.sleep(0.01)", timeout_s=0.5)
    assert report.timed_out and report.stdout == "started\n" and not report.succeeded


def test_the_runner_keeps_the_head_of_a_huge_output_and_counts_the_rest() -> None:
    report = _run_locally("print('z' * 10**7)", output_limit=100)
    assert report.stdout == "z" * python_runner.stdout_keep_bytes(100) and report.stdout_cut and report.succeeded


def test_the_program_reads_an_empty_stdin_and_undecodable_source_is_a_syntax_error() -> None:
    assert _run_locally("input()").stderr.strip().endswith("EOFError: EOF when reading a line")
    report = _run_locally("x = '\ud800'")  # a lone surrogate, as JSON can carry it
    assert report.exit_code == 1 and "SyntaxError" in python_runner.last_line(report.stderr)


def test_the_programs_own_report_lookalike_does_not_replace_the_runners() -> None:
    fake = python_runner.REPORT_MARK + json.dumps({"exit": 0, "timed_out": False, "spawn_error": None,
                                                    "stdout": "", "stdout_bytes": 0, "stderr": ""})
    report = _run_locally(f"print({fake!r})\nraise SystemExit(5)")
    assert report.exit_code == 5 and report.stdout == fake + "\n"


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its reaper counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_what_the_program_leaves_running_in_its_process_group_is_killed_with_it() -> None:
    report = _run_locally("import subprocess\nprint(subprocess.Popen(['sleep', '600']).pid)")
    pid = int(report.stdout)
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report.succeeded and not _alive(pid)
