"""Differential fuzzer of the public allocator API: the compiled kernels against the pure-Python
code they mirror (``KVSPEC_PURE_PYTHON=1``'s path), in one process, on full-attention,
sliding-window, Mamba, chunked-local, MLA and two-pool allocators, and on allocators with
small offload tiers (transfers taken and completed or failed, tier hits, forged tier loads),
with hostile token ids, request ids, salts, counts and forged prefixes, and one tiered
configuration whose eviction hooks tamper with the pools (only a crash is a finding there;
see ``fuzz_program.py``)::

    .venv/bin/python tests/fuzz/allocator_fuzz.py --seconds 60 --seed 1
    scripts/asan-kernels .venv/bin/python tests/fuzz/allocator_fuzz.py --seconds 150
    .venv/bin/python tests/fuzz/allocator_fuzz.py --replay '<the JSON of a finding>'

Each episode (one configuration, one random program) runs in a forked child, so a crash (a
segfault, or an AddressSanitizer report under ``scripts/asan-kernels``) is a finding like a
divergence and the run goes on. Each distinct finding is reported once, with the program
shrunk to the operations it needs (a ``--replay`` line). Exit status 1 when there are
findings.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import attrs  # noqa: E402
from fuzz_hostile import features, simplified  # noqa: E402
from fuzz_program import (  # noqa: E402
    CONFIGS,
    Generator,
    Op,
    SideFactory,
    make_sides,
    manager,
    random_setup,
    run_program,
)

#: Exit status of a child that finished its work, and of one whose harness code raised.
_DONE = 0
_HARNESS_ERROR = 3
#: Longest an automatic shrink of one finding may take (seconds).
SHRINK_SECONDS = 20.0


@attrs.define
class Finding:
    """One distinct finding: its key, what happened, and a shrunk program that shows it."""

    key: str
    detail: str
    setup: dict[str, Any]
    ops: list[Op]
    seen: int = 1

    def replay_json(self) -> str:
        return json.dumps({"setup": self.setup, "ops": self.ops}, separators=(",", ":"))


@attrs.define
class FuzzReport:
    seed: int
    seconds: float = 0.0
    ops: int = 0
    episodes: int = 0
    ops_per_config: Counter[str] = attrs.field(factory=Counter)
    #: By the key a finding was first seen under (before shrinking).
    findings: dict[str, Finding] = attrs.field(factory=dict)

    def distinct(self) -> list[Finding]:
        """One finding per key after shrinking (raw keys name incidental inputs too), the
        shortest program kept, occurrences added up."""
        merged: dict[str, Finding] = {}
        for finding in self.findings.values():
            known = merged.get(finding.key)
            if known is None:
                merged[finding.key] = attrs.evolve(finding)
            else:
                if len(finding.ops) < len(known.ops):
                    known.ops, known.detail = finding.ops, finding.detail
                known.seen += finding.seen
        return list(merged.values())

    def text(self) -> str:
        from kvspec_core.runtime.native import native

        per_config = ", ".join(
            f"{name} {count}" for name, count in sorted(self.ops_per_config.items())
        )
        lines = [
            f"allocator fuzz: seed {self.seed}, {self.seconds:.1f} s, {self.ops} operations "
            f"in {self.episodes} episodes ({per_config})",
            f"kernels: {getattr(native, '__file__', None)}",
            f"findings: {len(self.distinct())}",
        ]
        for number, finding in enumerate(self.distinct(), 1):
            lines += [
                f"[{number}] {finding.key}  (seen {finding.seen} times; "
                f"{len(finding.ops)} operations after shrinking)",
                *("    " + line for line in finding.detail.splitlines()),
                f"    repro: .venv/bin/python tests/fuzz/allocator_fuzz.py --replay "
                f"'{finding.replay_json()}'",
            ]
        return "\n".join(lines)


@attrs.frozen
class Outcome:
    """How one program ended: operations done, and a finding or none."""

    done: int
    index: int | None = None
    key: str | None = None
    detail: str = ""


def episode(seed: int, configs: list[str], number: int) -> tuple[dict[str, Any], list[Op]]:
    """Episode ``number`` of a run: its configuration (the configurations in turn) and its
    random program, from ``seed`` and ``number`` alone (a child makes the same ones)."""
    rng = random.Random(f"{seed}:{number}")
    setup = random_setup(rng, configs[number % len(configs)])
    tiered = "tiers" in setup["config"]
    # With tiers longer: a tier hit needs an eviction, its store completed, then a lookup.
    return setup, Generator(rng, tiered).program(
        rng.randrange(40, 121) if tiered else rng.randrange(20, 61)
    )


def _in_child(work: Callable[[Callable[[str], None]], None]) -> tuple[list[str], int, str]:
    """``work(emit)`` in a forked child, so that a crash there (a segfault, an
    AddressSanitizer report) is an answer, not our death: the lines it emitted, its wait
    status and its stderr."""
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as errors:
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            os.dup2(errors.fileno(), 2)
            faulthandler.disable()  # pytest's would print a crash to the terminal too
            status = _DONE
            try:
                work(lambda line: os.write(write_end, (line + "\n").encode()) and None)
            except BaseException:
                os.write(2, traceback.format_exc().encode())
                status = _HARNESS_ERROR
            os._exit(status)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            lines = reader.read().decode().splitlines()
        _, wait_status = os.waitpid(pid, 0)
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    return lines, wait_status, stderr


def _run_emitting(
    setup: dict[str, Any], ops: list[Op], emit: Callable[[str], None], sides: SideFactory
) -> bool:
    """Run one program, emitting progress and its result; whether it ended in a finding."""
    done, divergence = run_program(setup, ops, lambda index: emit(f"p {index}"), sides)
    result: dict[str, Any] = {"done": done}
    if divergence is not None:
        result.update(index=divergence.index, key=divergence.key, detail=divergence.detail)
    emit("r " + json.dumps(result))
    return divergence is not None


def _crash(ops: list[Op], index: int, wait_status: int, stderr: str) -> Outcome:
    op = ops[index] if ops else {"op": "setup"}
    tags = ",".join(features(op))
    where = f"{op['op']}[{tags}]" if tags else op["op"]
    return Outcome(
        index,
        index,
        f"crash: {_crash_cause(wait_status, stderr)} during {where}",
        _crash_detail(stderr),
    )


def run_in_child(setup: dict[str, Any], ops: list[Op], sides: SideFactory = make_sides) -> Outcome:
    """One program in a forked child."""

    def work(emit: Callable[[str], None]) -> None:
        _run_emitting(setup, ops, emit, sides)

    lines, wait_status, stderr = _in_child(work)
    last = 0
    for line in lines:
        if line.startswith("r "):
            result = json.loads(line[2:])
            return Outcome(
                result["done"], result.get("index"), result.get("key"), result.get("detail", "")
            )
        last = int(line[2:])
    return _crash(ops, last, wait_status, stderr)


def run_batch(
    seed: int, configs: list[str], first: int, deadline: float, sides: SideFactory = make_sides
) -> list[tuple[int, Outcome]]:
    """Episodes ``first``, ``first + 1``, ... in one forked child (forks are slow under
    AddressSanitizer), until ``deadline`` or a finding; each episode's outcome."""

    def work(emit: Callable[[str], None]) -> None:
        number = first
        while True:
            emit(f"e {number}")
            setup, ops = episode(seed, configs, number)
            # After a finding the child stops: the parent shrinks it, then goes on.
            if _run_emitting(setup, ops, emit, sides) or time.monotonic() >= deadline:
                return
            number += 1

    lines, wait_status, stderr = _in_child(work)
    outcomes: list[tuple[int, Outcome]] = []
    number, last = first, 0
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "e":
            number, last = int(rest), 0
        elif kind == "p":
            last = int(rest)
        elif kind == "r":
            result = json.loads(rest)
            outcomes.append(
                (
                    number,
                    Outcome(
                        result["done"],
                        result.get("index"),
                        result.get("key"),
                        result.get("detail", ""),
                    ),
                )
            )
            number = -1
    if number >= 0:  # the child died inside this episode
        _, ops = episode(seed, configs, number)
        outcomes.append((number, _crash(ops, last, wait_status, stderr)))
    return outcomes


def _crash_cause(wait_status: int, stderr: str) -> str:
    summary = re.search(r"SUMMARY: AddressSanitizer: (\S+)", stderr)
    if summary:
        # Named by the first frame in the kernels' own code (the summary's frame is often
        # CPython's, e.g. Py_INCREF of the freed object).
        frame = re.search(r"#\d+ 0x[0-9a-f]+ in (kv_\w+) \S*/(_native_src/[\w.]+:\d+)", stderr)
        place = f" in {frame.group(1)} ({frame.group(2)})" if frame else ""
        return f"AddressSanitizer {summary.group(1)}{place}"
    if os.WIFSIGNALED(wait_status):
        return f"killed by {signal.Signals(os.WTERMSIG(wait_status)).name}"
    code = os.WEXITSTATUS(wait_status)
    if code == _HARNESS_ERROR and "Traceback" in stderr:
        return "fuzzer harness error: " + stderr.strip().splitlines()[-1][:160]
    return f"exit status {code}"


def _crash_detail(stderr: str) -> str:
    """The lines of an AddressSanitizer report (or traceback) worth reading."""
    lines = stderr.splitlines()
    keep = [
        line
        for line in lines
        if "ERROR: AddressSanitizer" in line
        or re.search(r"#\d+ .* in kv_", line)
        or "SUMMARY" in line
    ]
    return "\n".join((keep or lines[-8:])[:12])


def base_key(key: str) -> str:
    """A finding's key without the tags of the hostile inputs involved."""
    return re.sub(r"\[[^\]]*\]", "", key)


def shrink(
    setup: dict[str, Any],
    ops: list[Op],
    outcome: Outcome,
    stop: float,
    sides: SideFactory = make_sides,
) -> tuple[list[Op], Outcome]:
    """The shortest program found before ``stop`` that still ends with the same kind of
    finding (operations dropped one at a time, then each one's hostile inputs made plain
    and prompts halved), and its outcome (its key names the inputs still needed)."""
    assert outcome.index is not None
    best, best_outcome = ops[: outcome.index + 1], outcome

    def reproduces(candidate: list[Op], same: str) -> bool:
        nonlocal best, best_outcome
        again = run_in_child(setup, candidate, sides)
        if again.key is None or again.index is None:
            return False
        if (again.key if same == "key" else base_key(again.key)) != (
            outcome.key if same == "key" else base_key(outcome.key or "")
        ):
            return False
        best, best_outcome = candidate[: again.index + 1], again
        return True

    if not reproduces(best[-1:], "key"):
        position = 0
        while position < len(best) - 1 and time.monotonic() < stop:
            if not reproduces(best[:position] + best[position + 1 :], "key"):
                position += 1
    # Then each operation's inputs, the last (failing) one first.
    position = len(best) - 1
    while position >= 0 and time.monotonic() < stop:
        if not any(
            reproduces(
                best[:position] + [plainer] + best[position + 1 :],
                "key" if position < len(best) - 1 else "base",
            )
            for plainer in simplified(best[position])
        ):
            position -= 1
        position = min(position, len(best) - 1)
    return best, best_outcome


def fuzz(
    seconds: float,
    seed: int,
    configs: list[str] | None = None,
    sides: SideFactory = make_sides,
    log: Any = None,
) -> FuzzReport:
    """Random programs for ``seconds`` (the last episode finishes; shrinking a finding may
    take up to :data:`SHRINK_SECONDS` past that); distinct findings once each, shrunk."""
    names = list(configs or CONFIGS)
    manager()  # imports the plugins once, here, not in every child
    report = FuzzReport(seed=seed)
    start = time.monotonic()
    deadline = start + seconds
    number = 0
    while time.monotonic() < deadline:
        # The batch runs before the loop rebinds ``number``, which ends at its last episode.
        outcomes = run_batch(seed, names, number, deadline, sides)
        for number, outcome in outcomes:
            report.episodes += 1
            report.ops += outcome.done
            report.ops_per_config[names[number % len(names)]] += outcome.done
            if outcome.key is None:
                continue
            known = report.findings.get(outcome.key)
            if known is not None:
                known.seen += 1
                continue
            setup, ops = episode(seed, names, number)
            stop = min(time.monotonic(), deadline) + SHRINK_SECONDS
            shrunk, final = shrink(setup, ops, outcome, stop, sides)
            report.findings[outcome.key] = finding = Finding(
                final.key or outcome.key, final.detail, setup, shrunk
            )
            if log is not None:
                print(
                    f"finding: {finding.key}\n  repro: --replay '{finding.replay_json()}'",
                    file=log,
                    flush=True,
                )
        number += 1
    report.seconds = time.monotonic() - start
    return report


def replay(program: dict[str, Any]) -> int:
    """Run one program in this process, printing each side's answers; 1 on a finding."""
    from fuzz_program import Side

    printed: list[tuple[Side, Side]] = []

    def sides(config: str, eviction: str, events: bool) -> tuple[Side, Side]:
        pair = make_sides(config, eviction, events)
        for side in pair:
            apply = side.apply

            def logged(op: Op, side: Side = side, apply: Any = apply) -> list[str]:
                answers = apply(op)
                print(f"  {side.name:8} {op['op']}: {answers}")
                return answers

            side.apply = logged  # type: ignore[method-assign]
        printed.append(pair)
        return pair

    ops = program["ops"]
    for op in ops:
        print(json.dumps(op))
    done, divergence = run_program(program["setup"], ops, sides=sides)
    if divergence is None:
        print(f"no finding in {done} operations")
        return 0
    print(f"finding at operation {divergence.index}: {divergence.key}\n{divergence.detail}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="time budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--configs", default="", help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    parser.add_argument("--report", type=Path, help="also write the report to this file")
    parser.add_argument("--replay", help="JSON of one finding's program (its repro line)")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(json.loads(args.replay))
    configs = [name for name in args.configs.split(",") if name] or None
    unknown = sorted(set(configs or ()) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    report = fuzz(args.seconds, args.seed, configs, log=sys.stderr)
    text = report.text()
    print(text)
    if args.report:
        args.report.write_text(text + "\n")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
