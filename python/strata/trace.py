"""strata-trace: merge the flight-recorder dumps of all ranks and name the
operation a hang is stuck on.

Each rank's World writes ``strata_trace_rank_<rank>.json`` (PyTorch's
flight-recorder JSON, see docs/observability.md) into its trace directory
when an operation fails, on SIGUSR1 or when asked. This module reads a
directory of them and, per process group, names the first operation that

- some rank never entered while others did (a rank that skipped a
  collective, or is stuck elsewhere),
- ranks entered with different operations or sizes,
- did not complete although every rank that left a dump entered it (then
  the ranks without a dump are the suspects: dead, or never dumped),

with the ranks on each side; and, for send/recv, a pending receive (or
send) whose partner never posted the matching operation, or posted it with
another size. What it cannot decide (a rank without a dump, a ring that no
longer holds the operations to compare) it says, rather than guess.

    strata-trace DIR                 # a report per group
    strata-trace DIR --json          # the same as JSON
    strata-trace DIR --torch-pickle OUT   # dumps as PyTorch's fr_trace reads them

``python -m torch.distributed.flight_recorder.fr_trace`` reads only pickled
dumps (torch/distributed/flight_recorder/components/loader.py); the
``--torch-pickle`` form writes one per rank, the same content, for it.
"""

import argparse
import ast
import json
import os
import pickle
import re
import sys
from collections import defaultdict

__all__ = ["load_dumps", "analyze", "format_report", "to_torch_pickles", "main"]

_DUMP_NAME = re.compile(r"^strata_trace_rank_(\d+)\.json$")

# The operation types PyTorch's fr_trace knows (components/types.py); the
# others (shrink) are left out of its pickles.
_TORCH_TYPES = {
    "broadcast", "reduce", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "barrier",
    "split", "send", "recv",
}


class TraceError(Exception):
    """A directory or dump strata-trace cannot read."""


def load_dumps(directory):
    """{rank: dump} of the strata_trace_rank_<rank>.json files in
    ``directory``. TraceError when it has none or one is unreadable."""
    if not os.path.isdir(directory):
        raise TraceError(f"{directory} is not a directory")
    dumps = {}
    for name in sorted(os.listdir(directory)):
        m = _DUMP_NAME.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as f:
                dump = json.load(f)
        except (OSError, ValueError) as e:
            raise TraceError(f"cannot read {path}: {e}") from e
        for key in ("version", "pg_config", "entries"):
            if key not in dump:
                raise TraceError(f"{path} is not a flight-recorder dump: no '{key}'")
        dumps[int(m.group(1))] = dump
    if not dumps:
        raise TraceError(f"no strata_trace_rank_<rank>.json in {directory}")
    return dumps


def _op_type(entry):
    name = entry["profiling_name"].rpartition(":")[2]
    return name.split(" ")[0]


def _describe_op(entry):
    sizes = entry["input_sizes"]
    return f"{_op_type(entry)} {sizes} {','.join(entry.get('input_dtypes') or [])}".strip()


def _ranks_text(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _groups(dumps):
    """{(uid, members tuple or None): {"name", "members", "by_rank": {job rank: [entries]},
    "wrapped": {job rank: bool}}}."""
    groups = {}
    for rank, dump in dumps.items():
        meta = dump.get("strata", {})
        wrapped = meta.get("recorded", 0) > meta.get("capacity", float("inf"))
        per_uid = defaultdict(list)
        for e in dump["entries"]:
            per_uid[e["process_group"][0]].append(e)
        for uid, cfg in dump["pg_config"].items():
            try:
                members = tuple(ast.literal_eval(cfg.get("ranks", "[]")))
            except (ValueError, SyntaxError):
                members = ()
            key = (uid, members or None)
            g = groups.setdefault(key, {"name": uid, "desc": cfg.get("desc", uid),
                                        "members": list(members), "by_rank": {},
                                        "wrapped": {}})
            g["by_rank"][rank] = per_uid.get(uid, [])
            g["wrapped"][rank] = wrapped
    return groups


def _collective_finding(g, no_dump):
    """The first collective of group ``g`` that some rank never entered or
    that ranks entered differently, or that did not complete; None when all
    is consistent."""
    by_rank = {r: [e for e in es if not e.get("is_p2p")] for r, es in g["by_rank"].items()}
    present = sorted(by_rank)
    if not present:
        return None
    seqs = {r: {e["collective_seq_id"]: e for e in es} for r, es in by_rank.items()}
    last = {r: max(s) if s else 0 for r, s in seqs.items()}
    first_kept = {r: (min(s) if s else last[r] + 1) for r, s in seqs.items()}
    # Sequence numbers every dumped rank's ring still holds.
    lo = max(first_kept.values())
    hi = max(last.values())
    for seq in range(lo, hi + 1):
        entered = [r for r in present if seq in seqs[r]]
        not_entered = [r for r in present if last[r] < seq]
        if not_entered:
            ref = seqs[entered[0]][seq]
            return {
                "kind": "not_entered", "seq": seq, "op": _op_type(ref),
                "profiling_name": ref["profiling_name"], "input_sizes": ref["input_sizes"],
                "entered": entered, "not_entered": not_entered, "no_dump": no_dump,
                "message": (f"collective #{seq} {_describe_op(ref)}: entered by "
                            f"{_ranks_text(entered)}; never entered by "
                            f"{_ranks_text(not_entered)} (its last collective on this group: "
                            + ", ".join(f"#{last[r]}" for r in not_entered) + ")"
                            + (f"; no dump from {_ranks_text(no_dump)}: cannot tell whether it "
                               f"entered it" if no_dump else "")),
            }
        if len(entered) < len(present):
            continue  # some ring lost it: compare from where all hold it
        variants = defaultdict(list)
        for r in entered:
            e = seqs[r][seq]
            variants[(_op_type(e), json.dumps(e["input_sizes"]), json.dumps(e["output_sizes"]),
                      ",".join(e.get("input_dtypes") or []))].append(r)
        if len(variants) > 1:
            vs = [{"op": k[0], "input_sizes": json.loads(k[1]), "output_sizes": json.loads(k[2]),
                   "dtype": k[3], "ranks": rs} for k, rs in variants.items()]
            vs.sort(key=lambda v: (-len(v["ranks"]), v["ranks"]))
            return {
                "kind": "mismatch", "seq": seq, "op": vs[0]["op"], "variants": vs,
                "no_dump": no_dump,
                "message": f"collective #{seq}: ranks entered it differently: " + "; ".join(
                    f"{_ranks_text(v['ranks'])}: {v['op']} {v['input_sizes']} {v['dtype']}"
                    for v in vs),
            }
        pending = [r for r in entered if seqs[r][seq]["state"] != "completed"]
        failed = [r for r in entered if (seqs[r][seq].get("strata") or {}).get("error")]
        if pending or failed:
            ref = seqs[entered[0]][seq]
            msg = (f"collective #{seq} {_describe_op(ref)}: every dumped rank entered it; not "
                   f"completed on {_ranks_text(pending)}" if pending else
                   f"collective #{seq} {_describe_op(ref)}: every dumped rank entered it")
            if failed:
                msg += f"; failed on {_ranks_text(failed)}"
            if no_dump:
                msg += (f"; no dump from {_ranks_text(no_dump)} (dead, or never dumped): the "
                        f"likely cause, but whether it entered it cannot be decided")
            else:
                msg += ("; every rank entered it with the same sizes: the cause is not a "
                        "mismatch between ranks (a slow or failed network, a backend error)")
            return {
                "kind": "stuck", "seq": seq, "op": _op_type(ref),
                "profiling_name": ref["profiling_name"], "input_sizes": ref["input_sizes"],
                "entered": entered, "pending": pending, "failed": failed, "no_dump": no_dump,
                "message": msg,
            }
    return None


def _p2p_findings(g, no_dump):
    """Sends/recvs left pending (unfinished, or failed: a deadline completes
    an operation with its error) whose partner has no pending counterpart,
    or one of another size."""
    members = g["members"]
    findings = []
    pending = defaultdict(list)  # (src, dst, type) -> [entries], job ranks
    for r, es in g["by_rank"].items():
        for e in es:
            failed = (e.get("strata") or {}).get("error")
            if not e.get("is_p2p") or (e["state"] == "completed" and not failed):
                continue
            peer = (e.get("strata") or {}).get("peer", -1)
            if members and 0 <= peer < len(members):
                peer = members[peer]
            t = _op_type(e)
            src, dst = (r, peer) if t == "send" else (peer, r)
            pending[(src, dst, t)].append(e)
    for (src, dst, t), es in sorted(pending.items()):
        poster, partner = (src, dst) if t == "send" else (dst, src)
        other = "recv" if t == "send" else "send"
        e = es[0]
        if partner in no_dump or partner not in g["by_rank"]:
            findings.append({
                "kind": "p2p_undecided", "op": t, "rank": poster, "peer": partner,
                "p2p_seq": e["p2p_seq_id"], "input_sizes": e["input_sizes"],
                "message": (f"rank {poster}'s {t} #{e['p2p_seq_id']} {e['input_sizes']} "
                            f"{'to' if t == 'send' else 'from'} rank {partner} is pending; no "
                            f"dump from rank {partner}: cannot tell whether it posted the "
                            f"{other}")})
            continue
        theirs = pending.get((src, dst, other), [])
        if not theirs:
            findings.append({
                "kind": "p2p_unmatched", "op": t, "rank": poster, "peer": partner,
                "p2p_seq": e["p2p_seq_id"], "input_sizes": e["input_sizes"],
                "message": (f"rank {poster}'s {t} #{e['p2p_seq_id']} {e['input_sizes']} "
                            f"{'to' if t == 'send' else 'from'} rank {partner} is pending, and "
                            f"rank {partner} has no pending {other} "
                            f"{'from' if t == 'send' else 'to'} rank {poster}: rank {partner} "
                            f"never posted it")})
        elif t == "recv" and theirs[0]["input_sizes"] != e["output_sizes"]:
            findings.append({
                "kind": "p2p_mismatch", "op": t, "rank": poster, "peer": partner,
                "p2p_seq": e["p2p_seq_id"], "input_sizes": e["input_sizes"],
                "peer_sizes": theirs[0]["input_sizes"],
                "message": (f"rank {dst}'s recv {e['output_sizes']} from rank {src} and rank "
                            f"{src}'s send {theirs[0]['input_sizes']} to rank {dst} differ in "
                            f"size")})
    return findings


def analyze(dumps):
    """The merged report of ``dumps`` ({rank: dump}) as a dict (the --json
    form)."""
    world_size = max(max((d.get("strata") or {}).get("world_size", 0) for d in dumps.values()),
                     max(dumps) + 1)
    missing = [r for r in range(world_size) if r not in dumps]
    report = {"world_size": world_size, "dumps": sorted(dumps), "missing_dumps": missing,
              "reasons": {str(r): (d.get("strata") or {}).get("reason", "")
                          for r, d in sorted(dumps.items())},
              "groups": [], "undecided": []}
    for (uid, members), g in sorted(_groups(dumps).items(), key=lambda kv: str(kv[0])):
        if not members:
            report["undecided"].append(
                f"group {uid}: its members are not in the dumps (a communicator made outside a "
                f"World): compared among the ranks that dumped it only")
        no_dump = [r for r in (g["members"] or []) if r not in dumps]
        item = {"group": uid, "desc": g["desc"], "ranks": g["members"], "no_dump": no_dump,
                "findings": []}
        c = _collective_finding(g, no_dump)
        if c is not None:
            item["findings"].append(c)
        item["findings"].extend(_p2p_findings(g, no_dump))
        if any(g["wrapped"].values()):
            item["ring_wrapped"] = sorted(r for r, w in g["wrapped"].items() if w)
        report["groups"].append(item)
    if missing:
        report["undecided"].append(
            f"no dump from {_ranks_text(missing)}: dead, or never dumped; what they entered "
            f"cannot be decided")
    return report


def format_report(report):
    lines = [f"{len(report['dumps'])} of {report['world_size']} ranks dumped"
             + (f"; missing: {_ranks_text(report['missing_dumps'])}"
                if report["missing_dumps"] else "")]
    for g in report["groups"]:
        head = f"group {g['group']} ({_ranks_text(g['ranks'])})" if g["ranks"] else \
            f"group {g['group']}"
        if not g["findings"]:
            lines.append(f"{head}: consistent (every rank entered the same operations)")
            continue
        for f in g["findings"]:
            lines.append(f"{head}: {f['message']}")
    for u in report["undecided"]:
        lines.append(f"cannot decide: {u}")
    return "\n".join(lines)


def to_torch_pickles(dumps, out):
    """Writes each dump as ``out/strata_trace_rank_<rank>`` in the pickled
    form PyTorch's fr_trace reads, without the operations it does not know;
    returns the paths."""
    os.makedirs(out, exist_ok=True)
    paths = []
    for rank, dump in sorted(dumps.items()):
        d = dict(dump)
        d["entries"] = [e for e in dump["entries"] if _op_type(e) in _TORCH_TYPES]
        path = os.path.join(out, f"strata_trace_rank_{rank}")
        with open(path, "wb") as f:
            pickle.dump(d, f)
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="strata-trace",
        description="Merge the flight-recorder dumps of all ranks (strata_trace_rank_<r>.json) "
                    "and name, per group, the first operation some rank never entered or "
                    "entered differently.")
    parser.add_argument("dir", help="the trace directory (STRATA_TRACE_DIR)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--torch-pickle", metavar="OUT",
                        help="also write the dumps into OUT as PyTorch's fr_trace reads them")
    args = parser.parse_args(argv)
    try:
        dumps = load_dumps(args.dir)
    except TraceError as e:
        print(f"strata-trace: {e}", file=sys.stderr)
        return 2
    if args.torch_pickle:
        to_torch_pickles(dumps, args.torch_pickle)
    report = analyze(dumps)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
