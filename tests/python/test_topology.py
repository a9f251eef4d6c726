"""strata.topology from Python, and the strata-topo command line: fixtures
of real machine types, the lint of the issue's guide, errors, exit codes."""

import json
import os
import subprocess
import sys

import pytest

import strata

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "topology")
CLI = os.environ.get("STRATA_TOPO_BIN")


def fixture(machine, *parts):
    return os.path.join(FIXTURES, machine, *parts)


def detect(machine, **kw):
    smi = fixture(machine, "nvidia-smi.txt")
    return strata.topology.detect(fixture(machine, "sys"), nvidia_smi=smi if os.path.exists(smi) else None,
                                  use_nvml=False, read_conf_files=False, env={}, **kw)


@pytest.mark.parametrize("machine,cls", [
    ("dgx_h100", "multi-node-infiniband"),
    ("pcie_8gpu_dual_socket", "pcie-only"),
    ("nvlink_pairs_4gpu", "nvlink-partial"),
    ("roce_cluster", "multi-node-roce"),
    ("aws_p4d", "aws-efa"),
    ("tcp_cloud_vm", "tcp-only"),
])
def test_fixture_classes(machine, cls):
    assert detect(machine, nccl_version="2.28.9").cls == cls


def test_dgx_profile_matrix_and_export():
    t = detect("dgx_h100", nccl_version="2.28.9")
    profile = {p.name: p for p in t.profile}
    assert profile["NCCL_IB_HCA"].value.startswith("=mlx5_0,")
    assert profile["netName"].target == "config"
    m = t.matrix()
    assert m["GPU0"]["GPU7"] == "NV18"
    assert m["GPU0"]["NIC0"] == "PIX"
    assert "export NCCL_IB_HCA='=mlx5_0," in t.export("env")
    assert "\nNCCL_IB_HCA==mlx5_0," in t.export("conf")
    assert "Legend:" in t.text()


def test_roce_profile_depends_on_the_nccl_version():
    old = {p.name: p.value for p in detect("roce_cluster", nccl_version="2.18.6").profile}
    new = {p.name: p.value for p in detect("roce_cluster", nccl_version="2.28.9").profile}
    assert old["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_GID_INDEX" not in new


def test_lint_of_the_guide():
    guide = {"NCCL_SOCKET_TIMEOUT": "600", "NCCL_BUFFERS_PER_CHANNEL": "4",
             "NCCL_TREE_THRESHOLD": "0", "NCCL_MIN_NRINGS": "4", "NCCL_MAX_NCHANNELS": "16",
             "NCCL_NTHREADS": "8", "NCCL_IB_RETRY_CNT": "13", "NCCL_ASYNC_ERROR_HANDLING": "1",
             "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_IB_GID_INDEX": "3"}
    findings = strata.topology.lint(guide, nccl_version="2.28.9", use_nvml=False)
    by = {(f.name, f.rule): f for f in findings}
    assert by[("NCCL_SOCKET_TIMEOUT", "unknown-name")].severity == "error"
    assert by[("NCCL_TREE_THRESHOLD", "removed")].severity == "error"
    assert by[("NCCL_NTHREADS", "out-of-range")].severity == "error"
    assert by[("NCCL_IB_RETRY_CNT", "out-of-range")].severity == "error"
    assert by[("NCCL_ASYNC_ERROR_HANDLING", "other-tool")].severity == "warning"
    assert by[("NCCL_MIN_NRINGS", "deprecated")].severity == "warning"
    assert by[("NCCL_IB_GID_INDEX", "pinned-gid")].severity == "warning"
    assert sum(f.severity == "error" for f in findings) == 5
    assert findings[0].severity == "error"


def test_lint_files_and_errors(tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_DEBUG = WARN\nNCCL_SOCKET_IFNAME=\"eth0\"\n")
    rules = {f.rule for f in strata.topology.lint({}, files=[conf], use_nvml=False)}
    assert {"space-in-name", "quoted-value"} <= rules
    with pytest.raises(strata.TopologyError, match="missing.conf"):
        strata.topology.lint({}, files=[tmp_path / "missing.conf"], use_nvml=False)
    with pytest.raises(strata.TopologyError, match="'latest'"):
        strata.topology.lint({}, nccl_version="latest")
    bad = tmp_path / "topo.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tWARP\nGPU1\tNV4\t X \n")
    with pytest.raises(strata.TopologyError, match="cell 'WARP'"):
        strata.topology.detect(nvidia_smi=bad)
    with pytest.raises(strata.TopologyError, match="does not exist"):
        strata.topology.detect(tmp_path / "nosys", use_nvml=False)
    with pytest.raises(strata.TopologyError, match="scope 'cluster'"):
        strata.topology.detect(scope="cluster")
    with pytest.raises(strata.TopologyError, match="format 'yaml'"):
        strata._strata._topology_report({}, "yaml")


def test_this_machine():
    t = strata.topology.detect(use_nvml=True)
    assert t.cls in {"single-node-nvswitch", "nvlink-partial", "pcie-only", "multi-node-infiniband",
                     "multi-node-roce", "aws-efa", "tcp-only"}
    assert "class" in t.data and "profile" in t.data and "lint" in t.data


@pytest.mark.skipif(not CLI, reason="STRATA_TOPO_BIN not set (run through ctest)")
def test_cli_json_exit_codes_and_export(tmp_path):
    base = [CLI, "--no-nvml", "--no-conf-files", "--nccl-version", "2.28.9"]
    ok = subprocess.run(base + ["--sysfs-root", fixture("dgx_h100", "sys"), "--from-nvidia-smi",
                                fixture("dgx_h100", "nvidia-smi.txt"), "--json"],
                        capture_output=True, text=True, env={"PATH": os.environ.get("PATH", "")})
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert d["class"] == "multi-node-infiniband"
    for p in d["profile"]:
        assert set(p) >= {"name", "value", "reason"}
    script = tmp_path / "job.sh"
    script.write_text("export NCCL_NTHREADS=8\n")
    bad = subprocess.run(base + ["--lint", str(script), "--json"], capture_output=True, text=True,
                         env={"PATH": os.environ.get("PATH", "")})
    assert bad.returncode == 1
    lint = json.loads(bad.stdout)["lint"]
    assert {"name", "value", "severity", "message"} <= set(lint[0])
    usage = subprocess.run(base + ["--export", "yaml"], capture_output=True, text=True)
    assert usage.returncode == 2 and "--export takes env or conf" in usage.stderr
    missing = subprocess.run(base + ["--from-xml", str(tmp_path / "none.xml")], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and "none.xml" in missing.stderr
    export = subprocess.run(base + ["--sysfs-root", fixture("dgx_h100", "sys"), "--export", "conf"],
                            capture_output=True, text=True)
    assert export.returncode == 0 and "NCCL_IB_HCA==mlx5_0" in export.stdout
    for args, message in ((["--frobnicate"], "unknown option '--frobnicate'"),
                          (["--scope", "cluster"], "--scope 'cluster'"),
                          (["--nccl-version", "latest"], "'latest'"),
                          (["--from-xml", "a.xml", "--from-nvidia-smi", "b.txt"], "alternatives"),
                          (["--lint"], "--lint needs a file")):
        r = subprocess.run(base + args, capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


@pytest.mark.skipif(not CLI, reason="STRATA_TOPO_BIN not set (run through ctest)")
def test_variable_doc_is_generated_from_the_table():
    table = subprocess.run([CLI, "--list-variables"], capture_output=True, text=True, check=True)
    with open(os.path.join(HERE, "..", "..", "docs", "nccl-variables.md")) as f:
        doc = f.read()
    assert doc.endswith(table.stdout), "regenerate docs/nccl-variables.md (see its header)"



GENERATOR = os.path.join(HERE, "..", "..", "src", "comm", "nccl_tuning", "gen_nccl_vars.py")
TABLE = os.path.join(HERE, "..", "..", "src", "comm", "nccl_tuning", "nccl_vars.tsv")


def generate(tmp_path, text):
    table = tmp_path / "nccl_vars.tsv"
    table.write_text(text)
    return subprocess.run([sys.executable, GENERATOR, "--input", str(table),
                           "--output", str(tmp_path / "out.cc")], capture_output=True, text=True)


def test_the_variable_table_generator_names_each_bad_row_by_its_line(tmp_path):
    """The build turns nccl_vars.tsv into C++; a malformed row must fail it
    with the row's line number (the real table is line-numbered the same)."""
    with open(TABLE) as f:
        lines = f.read().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name\t"))
    ok = generate(tmp_path, "\n".join(lines) + "\n")
    assert ok.returncode == 0, ok.stderr
    rows = (tmp_path / "out.cc").read_text().count("// line ")
    assert rows == len(lines) - header - 1
    first = lines[header + 1].split("\t")  # NCCL_SOCKET_IFNAME, line header + 2

    def with_first(**changes):
        fields = list(first)
        for column, value in changes.items():
            fields[["name", "type", "range", "values", "case_sensitive", "default", "since",
                    "removed", "deprecated", "replacement", "debug", "documented", "out_of_range",
                    "meaning", "source"].index(column)] = value
        return "\t".join(fields)

    for bad, message in (
            ("\t".join(first[:-1]), "14 tab-separated fields, expected 15"),
            (with_first(type="float"), "type 'float' is not one of"),
            (with_first(since="2.x"), "since '2.x' is not a version"),
            (with_first(removed="2.3.5", since="2.5.6"), "removed 2.3.5 is not after since 2.5.6"),
            (with_first(range="16..1"), "range '16..1' is empty"),
            (with_first(documented="maybe"), "documented 'maybe' is not yes or no"),
            (with_first(replacement="NCCL_NOT_A_ROW"), "replacement NCCL_NOT_A_ROW is not a row"),
            (with_first(meaning=""), "meaning is empty")):
        broken = lines[:header + 1] + [bad] + lines[header + 2:]
        r = generate(tmp_path, "\n".join(broken) + "\n")
        where = f"nccl_vars.tsv:{header + 2}: "
        assert r.returncode != 0 and where in r.stderr and message in r.stderr, (message, r.stderr)
    # A name listed twice: the second row is the bad one.
    broken = lines[:header + 2] + [lines[header + 1]] + lines[header + 2:]
    r = generate(tmp_path, "\n".join(broken) + "\n")
    assert r.returncode != 0, r.stderr
    assert f"nccl_vars.tsv:{header + 3}: {first[0]}: listed again (first on line {header + 2})" \
        in r.stderr, r.stderr
