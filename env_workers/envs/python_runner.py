"""The python family's code interpreter: a small runner program that runs inside the sandbox, and the pure
rules that turn what it reports into the text the policy sees.

The sandbox runs one process per call (`Sandbox.run`, AgentBench's exec_run) whose stdout and stderr come
back merged (bubblewrap keeps the first 64 KiB, Docker all of it, in memory). ToRL shows the policy the
program's standard output and, when it fails, only the last line of the error (`NameError: name 'a' is not
defined`: the traceback's file paths are noise), so the two streams must be told apart, and the error line
must survive a program that prints megabytes. Hence the runner (`RUNNER`, the sandbox's Debian Python 3;
the code reaches it as a base64 argument): it starts the code as a child interpreter in its own process
group with the code on the child's stdin (no file to write on a disk earlier code may have filled; the
program then reads an empty stdin), keeps the first `keep` bytes of the child's stdout and the last `tail`
bytes of its stderr while draining the rest, kills the child's whole process group when it exits or at
the time limit (what the code left running in the background goes with it), and prints one report line:
`REPORT_MARK` and a JSON object with the exit status, whether the time limit hit, both streams in base64
and the stdout's full size. The rest is the environment's: `parse_report` reads the report (None when
there is none: the code killed its runner, or the sandbox died), `tool_text` writes the message.

The code is hostile input: its output is cut as the os family cuts shell output (`truncate_output`, the
sandbox settings' `output_limit`/`output_keep`), and undecodable bytes become U+FFFD; the agent loop then
makes any control token in it plain text, as for every environment message.
"""

from __future__ import annotations

import base64
import binascii
import json
import signal
from dataclasses import dataclass

from env_workers.sandbox.base import TRUNCATION_NOTE, truncate_output

REPORT_MARK = "__rollstream_python_report__"
# Bytes of stderr kept: the error's last line is in them unless one line is longer (then its tail is shown).
STDERR_TAIL_BYTES = 4096
# Largest code accepted, in UTF-8 bytes: its base64 (4/3 larger) must pass as one argument, which Linux
# caps at 128 KiB (MAX_ARG_STRLEN).
MAX_CODE_BYTES = 64 * 1024
# What a program that printed nothing shows (as the os family's "The output of the OS is empty.").
EMPTY_OUTPUT = "The code ran and printed nothing."

RUNNER = r"""
import base64, json, os, signal, subprocess, sys, threading
keep, tail, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
source = base64.b64decode(sys.argv[4])
head, end, size = bytearray(), bytearray(), [0]

def read_head(stream):
    for chunk in iter(lambda: stream.read1(65536), b""):
        size[0] += len(chunk)
        if len(head) < keep:
            head.extend(chunk[:keep - len(head)])

def read_tail(stream):
    for chunk in iter(lambda: stream.read1(65536), b""):
        end.extend(chunk)
        del end[:-tail]

report = {"exit": None, "timed_out": False, "spawn_error": None}
try:
    child = subprocess.Popen([sys.executable, "-E", "-s", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True,
                             cwd="/root" if os.path.isdir("/root") else "/")
except Exception as error:
    report["spawn_error"] = repr(error)
else:
    readers = [threading.Thread(target=read_head, args=(child.stdout,), daemon=True),
               threading.Thread(target=read_tail, args=(child.stderr,), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        child.stdin.write(source)
        child.stdin.close()
    except OSError:
        pass
    try:
        child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        report["timed_out"] = True
    try:  # the code's background processes too (its group outlives it while one is left)
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    child.wait()
    for reader in readers:  # bounded: a process that left the group (a new session) may hold a pipe open
        reader.join(1.0)
    report["exit"] = child.returncode
report.update(stdout=base64.b64encode(bytes(head)).decode(), stdout_bytes=size[0],
              stderr=base64.b64encode(bytes(end)).decode())
sys.stdout.write("\n" + sys.argv[5] + json.dumps(report) + "\n")
"""


def stdout_keep_bytes(output_limit: int) -> int:
    """Bytes of stdout the runner keeps: enough for `output_limit` + 1 characters of UTF-8 (at most 4 bytes
    each), so the cut is decided on the text as the os family decides it; at most 16 KiB, so the report's
    base64 stays far under the sandbox's 64 KiB of output."""
    return min(4 * (output_limit + 1), 16 * 1024)


def runner_argv(code: str, output_limit: int, timeout_s: float) -> list[str]:
    """The process that runs `code` in the sandbox. Lone surrogates (JSON can carry them) pass as their
    bytes, which the child then rejects as a SyntaxError like any other undecodable source."""
    encoded = base64.b64encode(code.encode("utf-8", "surrogatepass")).decode()
    return ["python3", "-I", "-S", "-c", RUNNER, str(stdout_keep_bytes(output_limit)), str(STDERR_TAIL_BYTES),
            repr(float(timeout_s)), encoded, REPORT_MARK]


def code_too_long(code: str) -> bool:
    return len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES


@dataclass(frozen=True)
class Report:
    """What the runner saw of one program: exit status (negative: killed by that signal; None: never
    started), whether it ran past the time limit, its stdout head and stderr tail (decoded), and whether the
    runner kept less stdout than the program wrote."""

    exit_code: int | None
    timed_out: bool
    stdout: str
    stdout_cut: bool
    stderr: str
    spawn_error: str | None = None

    @property
    def succeeded(self) -> bool:
        """ToRL's "code executed": the program ran to its end and exited 0."""
        return self.exit_code == 0 and not self.timed_out and self.spawn_error is None


def _bytes(encoded: object) -> bytes:
    if not isinstance(encoded, str):
        raise ValueError("not base64 text")
    return base64.b64decode(encoded, validate=True)


def parse_report(output: str) -> Report | None:
    """The report on the output's last marked line; None when there is none or it is malformed."""
    at = output.rfind(REPORT_MARK)
    if at < 0:
        return None
    line = output[at + len(REPORT_MARK):].split("\n", 1)[0]
    try:
        raw = json.loads(line)
        exit_code, timed_out, spawn_error = raw["exit"], raw["timed_out"], raw["spawn_error"]
        stdout, stderr, stdout_bytes = _bytes(raw["stdout"]), _bytes(raw["stderr"]), raw["stdout_bytes"]
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    if not (exit_code is None or type(exit_code) is int) or type(timed_out) is not bool \
            or type(stdout_bytes) is not int or not (spawn_error is None or isinstance(spawn_error, str)):
        return None
    return Report(exit_code, timed_out, stdout.decode("utf-8", errors="replace"), stdout_bytes > len(stdout),
                  stderr.decode("utf-8", errors="replace"), spawn_error)


def last_line(text: str) -> str:
    """The last line that is not blank (a traceback's last line is the exception and its message)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def error_line(report: Report, timeout_s: float) -> str | None:
    """The one line of error the policy sees, or None when the program succeeded."""
    if report.spawn_error is not None:
        return f"Error: the interpreter could not start ({report.spawn_error})"
    if report.timed_out:
        return f"TimeoutError: the code ran past the limit of {timeout_s:g} s and was stopped"
    if report.exit_code is None or report.exit_code == 0:
        return None
    if report.exit_code < 0:
        return (f"Error: the code was killed by {_signal_name(-report.exit_code)} (a limit of the sandbox: "
                f"memory, processes, CPU time or file size)")
    return last_line(report.stderr) or f"Error: the code exited with status {report.exit_code}"


def tool_text(report: Report, timeout_s: float, output_limit: int, output_keep: int) -> str:
    """The tool message: the program's stdout (cut as the os family cuts shell output), then its error line."""
    stdout = report.stdout
    if report.stdout_cut and len(stdout) <= output_limit:  # the runner cut it before the text limit did
        stdout += TRUNCATION_NOTE
    else:
        stdout = truncate_output(stdout, output_limit, output_keep)
    error = error_line(report, timeout_s)
    if error is None:
        return stdout if stdout else EMPTY_OUTPUT
    error = truncate_output(error, output_limit, output_keep)
    return f"{stdout}\n{error}" if stdout and not stdout.endswith("\n") else stdout + error


def lost_text(timed_out: bool, timeout_s: float) -> str:
    """The tool message of a run that left no report: the runner was killed, or the sandbox died under it."""
    cause = (f"the code ran past the limit of {timeout_s:g} s and was killed" if timed_out
             else "the code's interpreter ended without a report (did the code kill it?)")
    return f"Error: {cause}; the sandbox was reset, so files written by earlier runs are gone."
