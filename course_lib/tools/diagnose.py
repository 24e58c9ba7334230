"""Name why a run hung or broke, from the flight records its ranks wrote.

    python -m course_lib.tools.diagnose DIR

``DIR`` holds one ``rank-<r>.json`` per rank (``flight_recorder``: the trainer's
``--flight-recorder DIR``, or ``COURSE_FLIGHT_RECORDER=DIR``) and, from a GPU run, PyTorch's own
dumps (``nccl_trace_rank_<r>``). The records are merged per process group, collective by
collective (the n-th collective of a group must be the same call on every member), and the first
cause found is printed on one line, then the evidence:

- a rank that left no record (it died: killed, out of memory, a crash in native code);
- ranks that made different calls, or the same call with different sizes, at the same number;
- a rank that never reached collective #n of a group that the others waited in, and where it
  was instead (the collective it waited in, or its main thread's stack);
- the last collective every rank completed.

- a rank that stopped with an error although every rank completed the same collectives: the
  cause is in that rank's own work.

Exit status 0 with "no problem found" only when every rank finished (or was asked for its record
while it ran) and completed the same collectives; 1 when a cause is named; 2 when the folder
cannot be read (no records; records of different runs, by their run id or because one rank
started after another's record was written; a truncated record or one missing a field), with one
line that says which.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass, field, fields
from pathlib import Path

from .. import checks
from ..distributed.hooks import FINISHED
from ..errors import UserError
from ..observe.flight_recorder import FORMAT, PYTORCH_PREFIX, Entry


@dataclass
class RankRecord:
    """What one rank wrote: its entries (oldest first), why it wrote, and where it was."""

    rank: int
    world_size: int
    run_id: str
    reason: str
    where: list[str]
    entries: list[dict]
    source: str  # the file it came from
    replicas: dict | None = None  # {parameter: fingerprint}, for a data-parallel replica
    started_s: float | None = None  # when its recorder started (None: PyTorch's dump)
    written_s: float | None = None  # when it wrote the record


@dataclass
class Diagnosis:
    """The cause in one line, the evidence, and whether anything is wrong.

    Args:
        cause: the first cause found, in one line (or "no problem found").
        evidence: the lines that show it: each rank's call, where a rank was, the last common collective.
        problem: whether anything is wrong (False: "no problem found").
    """

    cause: str
    _: KW_ONLY
    evidence: list[str] = field(default_factory=list)
    problem: bool = True

    def text(self) -> str:
        return "\n".join([self.cause, *(f"  {line}" for line in self.evidence)])


def load(folder: str | Path) -> dict[int, RankRecord]:
    """Every rank's record in ``folder``: the course's and, where present, PyTorch's NCCL dumps.

    Args:
        folder: where the ranks wrote them.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: give the folder the ranks wrote their flight records to")
    records: dict[int, RankRecord] = {}
    for path in sorted(folder.glob("rank-*.json")):
        record = _read_course_record(path)
        records[record.rank] = record
    for path in sorted(folder.glob(f"{PYTORCH_PREFIX}*")):
        if path.suffix in ("", ".pkl") and path.name[len(PYTORCH_PREFIX) :].split(".")[0].isdigit():
            record = _read_pytorch_dump(path)
            records.setdefault(record.rank, record)  # the course's record, where both are, says more
    if not records:
        raise UserError(
            f"{folder} holds no flight records (rank-<r>.json): run with --flight-recorder {folder} "
            f"(or COURSE_FLIGHT_RECORDER={folder}) and look again after the run stops"
        )
    runs = {record.run_id for record in records.values() if record.run_id}
    if len(runs) > 1:
        raise UserError(
            f"{folder} holds records of different runs ({', '.join(sorted(runs))}): give one run's folder, "
            "or empty it before the next run"
        )
    _check_one_run(folder, records)
    return records


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _check_one_run(folder: Path, records: dict[int, RankRecord]) -> None:
    """Refuse records of two runs under one run id (torchrun's default id is "none"): the ranks of
    one run all start before any of them writes its final record, so a record whose rank started
    after another record was written is a later run's."""
    timed = [r for r in records.values() if r.started_s is not None and r.written_s is not None]
    if not timed:
        return
    first_written = min(timed, key=lambda r: r.written_s)
    last_started = max(timed, key=lambda r: r.started_s)
    if last_started.started_s > first_written.written_s:
        raise UserError(
            f"{folder} holds records of two runs: {last_started.source} was started at "
            f"{_clock(last_started.started_s)}, after {first_written.source} was written at "
            f"{_clock(first_written.written_s)}: give each run a folder of its own, or empty it before "
            "the next run"
        )


ENTRY_FIELDS = (*(field.name for field in fields(Entry)), "state")
"""What each entry of a course record holds (``flight_recorder.Entry`` and its state): the diagnosis
reads them all."""


def _read_course_record(path: Path) -> RankRecord:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path} is not a complete flight record (truncated, or not one): {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path} is not a course flight record (its format is not {FORMAT})")
    for index, entry in enumerate(data.get("entries") or []):
        missing = [key for key in ENTRY_FIELDS if not isinstance(entry, dict) or key not in entry]
        if missing:
            raise UserError(
                f"{path} is not a complete flight record: its entry {index} has no "
                f"{', '.join(map(repr, missing))} (written by another version of the course, or edited): "
                "record the run again"
            )
    try:
        return RankRecord(
            rank=int(data["rank"]),
            world_size=int(data["world_size"]),
            run_id=str(data["run_id"]),
            reason=str(data["reason"]),
            where=list(data["where"]),
            entries=[
                dict(e, group_ranks=tuple(e["group_ranks"]), shape=tuple(e["shape"])) for e in data["entries"]
            ],
            source=path.name,
            replicas=data.get("replicas"),
            started_s=float(data["started_s"]),
            written_s=float(data["written_s"]),
        )
    except KeyError as error:
        raise UserError(
            f"{path} is not a complete flight record: it has no field {error.args[0]!r} (written by another "
            "version of the course, or edited): record the run again"
        ) from None
    except (TypeError, ValueError) as error:
        raise UserError(f"{path} is not a complete flight record: {error!r} is missing or wrong") from None


def _read_pytorch_dump(path: Path) -> RankRecord:
    """One of PyTorch's NCCL flight-recorder dumps, as the course's entries."""
    try:
        with path.open("rb") as file:
            dump = pickle.load(file)
        groups = {uid: tuple(json.loads(str(c["ranks"]))) for uid, c in dump.get("pg_config", {}).items()}
        entries = []
        for raw in dump["entries"]:
            group = groups.get(str(raw["process_group"][0]), ())
            frames = raw.get("frames") or []
            caller = f"{frames[0]['filename']}:{frames[0]['line']} in {frames[0]['name']}" if frames else ""
            sizes = raw.get("input_sizes") or [[]]
            dtypes = raw.get("input_dtypes") or [""]
            entries.append(
                {
                    "sequence": int(raw.get("collective_seq_id", -1)) - 1,  # PyTorch counts from 1
                    "op": str(raw["profiling_name"]).split(":")[-1],
                    "group_ranks": group,
                    "shape": tuple(sizes[0]) if sizes else (),
                    "dtype": str(dtypes[0]).lower() if dtypes else "",
                    "issued_s": raw.get("time_created_ns", 0) / 1e9,
                    "completed_s": None
                    if raw.get("state") != "completed"
                    else raw.get("time_created_ns", 0) / 1e9,
                    "caller": caller,
                    "peer": None,
                    "state": "completed" if raw.get("state") == "completed" else "issued",
                }
            )
    except Exception as error:  # noqa: BLE001 (a pickle fails in many ways; each means the same)
        raise UserError(f"{path} is not a complete PyTorch flight-recorder dump: {error!r}") from None
    rank = int(path.name[len(PYTORCH_PREFIX) :].split(".")[0])
    return RankRecord(rank, 0, "", "PyTorch's dump", [], entries, path.name)


def _describe(entry: dict) -> str:
    shape = "x".join(str(d) for d in entry["shape"]) or "scalar"
    return f"{entry['op']} of {entry['dtype'] or '?'} [{shape}]"


def _group_name(ranks: tuple[int, ...]) -> str:
    return f"group ({', '.join(map(str, ranks))})"


def diagnose(records: dict[int, RankRecord]) -> Diagnosis:
    """The first cause the records show, and its evidence.

    Args:
        records: what ``load`` returned.
    """
    world = max([r.world_size for r in records.values()] + [max(records) + 1])
    missing = [rank for rank in range(world) if rank not in records]
    # per group: {rank: {sequence: entry}}; the point-to-point calls (-1) have no common number
    by_group: dict[tuple[int, ...], dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for record in records.values():
        for entry in record.entries:
            if entry["sequence"] >= 0:
                by_group[entry["group_ranks"]][record.rank][entry["sequence"]] = entry

    if missing:
        waiting = _waiting(records)
        return Diagnosis(
            f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} left no record: "
            f"{'they' if len(missing) > 1 else 'it'} died before the others stopped (killed, out of memory, "
            "or a crash in native code): look at its log's last lines",
            evidence=[f"rank {rank} was waiting in {text}" for rank, text in waiting.items()]
            + [f"records: {', '.join(str(r) for r in sorted(records))} of {world} ranks"],
        )

    # every collective the present ranks of a group all made, in order: compared twice below
    shared_calls = []
    for group, ranks in sorted(by_group.items()):
        present = [rank for rank in group if rank in ranks]
        shared = sorted(set.intersection(*(set(ranks[rank]) for rank in present))) if present else []
        shared_calls += [(group, n, {rank: ranks[rank][n] for rank in present}) for n in shared]

    for group, sequence, calls in shared_calls:
        kinds = {(e["op"], e["dtype"], e["shape"]) for e in calls.values()}
        if len(kinds) > 1:
            ops = {e["op"] for e in calls.values()}
            what = "different collectives" if len(ops) > 1 else "the same collective with different sizes"
            odd = _odd_one_out(calls, lambda e: (e["op"], e["dtype"], e["shape"]))
            return Diagnosis(
                f"{_group_name(group)}, collective #{sequence}: the ranks made {what}"
                + (f"; rank {odd} is the odd one" if odd is not None else ""),
                evidence=_calls_evidence(calls) + _last_common(by_group),
            )

    for group, sequence, calls in shared_calls:  # the same call from different lines: one skipped one
        if len({e["caller"] for e in calls.values()}) > 1:
            odd = _odd_one_out(calls, lambda e: e["caller"])
            return Diagnosis(
                f"{_group_name(group)}, collective #{sequence}: the ranks made it from different lines: "
                "one rank skipped a collective, or made one more, before it"
                + (f" (rank {odd}, the odd one)" if odd is not None else ""),
                evidence=_calls_evidence(calls) + _last_common(by_group),
            )

    gaps = []  # per group whose ranks did not reach the same collective: (group, #, ahead, behind)
    for group, ranks in sorted(by_group.items()):
        reached = {rank: max(ranks[rank], default=-1) if rank in ranks else -1 for rank in group}
        furthest = max(reached.values())
        behind = [rank for rank, last in reached.items() if last < furthest]
        if behind:
            gaps.append((group, furthest, [rank for rank in group if reached[rank] == furthest], behind))
    for group, number, ahead, _ in gaps:  # alone in a group, and missing from another: the wrong group
        elsewhere = [gap for gap in gaps if ahead == [ahead[0]] and ahead[0] in gap[3]]
        if elsewhere and len(group) > 2:
            rank, (other, other_number, waiting, _) = ahead[0], elsewhere[0]
            entry, expected = by_group[group][rank][number], by_group[other][waiting[0]][other_number]
            them = f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))}"
            return Diagnosis(
                f"rank {rank} made collective #{number} on {_group_name(group)}, where no other rank made "
                f"it, instead of #{other_number} on {_group_name(other)}, where {them} waited: a collective "
                "on the wrong group",
                evidence=[
                    f"rank {rank}: {_describe(entry)} on {_group_name(group)} at {entry['caller']}",
                    f"{them}: {_describe(expected)} on {_group_name(other)} at {expected['caller']}",
                ]
                + _last_common(by_group),
            )
    if gaps:
        group, furthest, ahead, behind = gaps[0]
        entry = by_group[group][ahead[0]][furthest]
        evidence = [
            f"ranks {', '.join(map(str, ahead))} called it: {_describe(entry)} at {entry['caller']}"
            + ("" if entry["state"] == "completed" else ", and waited")
        ]
        for rank in behind:
            evidence.append(f"rank {rank} was instead {_where(records[rank])}")
        return Diagnosis(
            f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never reached collective "
            f"#{furthest} of {_group_name(group)} ({entry['op']}), which rank{'s' if len(ahead) > 1 else ''} "
            f"{', '.join(map(str, ahead))} waited in",
            evidence=evidence + _last_common(by_group),
        )

    errors = {
        rank: r.reason for rank, r in sorted(records.items()) if r.reason.startswith("stopped by an error")
    }
    if errors:  # the collectives agree: the cause is what the ranks raised
        reasons = sorted(set(errors.values()))
        return Diagnosis(
            f"no collective went wrong; rank{'s' if len(errors) > 1 else ''} {', '.join(map(str, errors))} "
            f"{reasons[0]}" + (f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else ""),
            evidence=[f"rank {rank}: {reason}" for rank, reason in errors.items()] + _last_common(by_group),
        )

    drift = _replicas_differ(records)
    if drift:
        return Diagnosis(drift[0], evidence=drift[1:] + _last_common(by_group))

    stuck = _waiting(records)
    if stuck:
        return Diagnosis(
            "every rank reached the same collectives, but some never completed: the transport failed "
            "(a network or GPU fault: look at the ranks' logs and NCCL's)",
            evidence=[f"rank {rank} waited in {text}" for rank, text in stuck.items()]
            + _last_common(by_group),
        )
    failed = {rank: r.reason for rank, r in sorted(records.items()) if _failed(r.reason)}
    if failed:
        rank, reason = next(iter(failed.items()))
        return Diagnosis(
            f"no collective went wrong, but rank {rank}'s run did not finish ({reason}): read its log's "
            "last lines",
            evidence=[f"rank {r} wrote its record because: {why}" for r, why in failed.items()]
            + _last_common(by_group),
        )
    return Diagnosis(
        "no problem found: every rank completed the same collectives",
        evidence=_last_common(by_group),
        problem=False,
    )


def _failed(reason: str) -> bool:
    """Whether a record's reason says its run failed: anything but a program that returned
    (``hooks.FINISHED``) or a dump asked of a live run (SIGUSR2); PyTorch's dumps say nothing."""
    return reason not in (FINISHED, "SIGUSR2", "PyTorch's dump")


def _replicas_differ(records: dict[int, RankRecord]) -> list[str]:
    """The first parameter whose fingerprint differs between ranks that all finished, and who holds what."""
    finished = [r for r in records.values() if r.reason.startswith("finished") and r.replicas]
    if len(finished) < 2 or len(finished) != len(records):
        return []
    for name in finished[0].replicas:
        values = defaultdict(list)
        for record in finished:
            values[record.replicas.get(name)].append(record.rank)
        if len(values) > 1:
            sides = " and ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in values.values()
            )
            return [
                f"the replicas differ at the end: parameter {name!r} has {len(values)} values ({sides}): the "
                "ranks did not apply the same update (--check-replicas N finds the step it happened)",
            ]
    return []


def _calls_evidence(calls: dict[int, dict]) -> list[str]:
    return [f"rank {rank}: {_describe(e)} at {e['caller']}" for rank, e in sorted(calls.items())]


def _odd_one_out(calls: dict[int, dict], key) -> int | None:
    """The one rank whose call differs from all the others' (None: no majority to differ from)."""
    counts = defaultdict(list)
    for rank, entry in calls.items():
        counts[key(entry)].append(rank)
    if len(calls) > 2 and len(counts) == 2:
        singles = [ranks[0] for ranks in counts.values() if len(ranks) == 1]
        return singles[0] if singles else None
    return None


def _waiting(records: dict[int, RankRecord]) -> dict[int, str]:
    """Each rank whose last entry did not complete: what it waited in."""
    waiting = {}
    for rank, record in sorted(records.items()):
        if record.entries and record.entries[-1]["state"] != "completed":
            entry = record.entries[-1]
            number = (
                f"#{entry['sequence']} of {_group_name(entry['group_ranks'])}"
                if entry["sequence"] >= 0
                else ""
            )
            waiting[rank] = f"{_describe(entry)} {number} at {entry['caller']}".replace("  ", " ")
    return waiting


def _where(record: RankRecord) -> str:
    """Where a rank was when it wrote: the collective it waited in, or its main thread's innermost lines."""
    if record.entries and record.entries[-1]["state"] != "completed":
        entry = record.entries[-1]
        number = f"#{entry['sequence']} of {_group_name(entry['group_ranks'])}"
        return f"waiting in {_describe(entry)} ({number}) at {entry['caller']}"
    if record.reason.startswith("finished"):
        last = next((e for e in reversed(record.entries) if e["sequence"] >= 0), None)
        made = f"; its last was {_describe(last)} at {last['caller']}" if last else ""
        return f"finished: its program ended without making it{made}"
    if record.where:
        return "at " + " <- ".join(reversed(record.where[-3:]))
    return "somewhere its record does not say (no stack)"


def _last_common(by_group) -> list[str]:
    lines = []
    for group, ranks in sorted(by_group.items()):
        if set(ranks) != set(group):
            continue
        done = [{s for s, e in ranks[rank].items() if e["state"] == "completed"} for rank in group]
        common = set.intersection(*done) if done else set()
        if common:
            last = max(common)
            lines.append(
                f"last collective every rank of {_group_name(group)} completed: #{last} "
                f"({_describe(ranks[group[0]][last])} at {ranks[group[0]][last]['caller']})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.tools.diagnose",
        description="Name why a run hung or broke, from the flight records its ranks wrote.",
    )
    parser.add_argument("folder", type=Path, help="where the ranks wrote rank-<r>.json (--flight-recorder)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    args = parser.parse_args(argv)
    try:
        records = load(args.folder)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    found = diagnose(records)
    if args.json:
        print(
            json.dumps({"cause": found.cause, "evidence": found.evidence, "problem": found.problem}, indent=1)
        )
    else:
        reasons = "; ".join(
            f"rank {r.rank}: {r.reason[:80]}{'...' if len(r.reason) > 80 else ''}"
            for r in sorted(records.values(), key=lambda r: r.rank)
        )
        print(found.text())
        print(f"  (why each rank wrote: {reasons})")
    return 1 if found.problem else 0


if __name__ == "__main__":
    checks.exit_with(main)
