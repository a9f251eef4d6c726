"""What this machine looks like to NCCL, what NCCL should be told, and what is
wrong with the NCCL settings in force (the Python face of ``strata-topo``).

    import strata
    topo = strata.topology.detect()            # this machine, this environment
    print(topo.cls, topo.reason)                # "tcp-only", "no GPU; ..."
    print(topo.text())                          # the full readable report
    for f in strata.topology.lint({"NCCL_NTHREADS": "8"}):
        print(f.severity, f.name, f.message)    # error NCCL_NTHREADS 8 is not ...

Errors (an unreadable file, a malformed ``nvidia-smi topo -m`` text) raise
:class:`strata.TopologyError` naming the file and line.
"""

import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from . import _strata

__all__ = ["Finding", "ProfileEntry", "TopologyReport", "check_consistency", "detect", "lint"]


@dataclass(frozen=True)
class Finding:
    """One lint finding: ``severity`` is "error", "warning" or "info"."""

    name: str
    value: str
    severity: str
    message: str
    fix: str
    rule: str
    origin: str


@dataclass(frozen=True)
class ProfileEntry:
    """A setting of the NCCL profile; ``target`` is "env" or "config"."""

    name: str
    value: str
    reason: str
    target: str
    user_set: bool = False
    user_value: Optional[str] = None


@dataclass
class TopologyReport:
    """The report of :func:`detect`; ``data`` is the strata-topo --json object."""

    data: Dict
    _options: Dict = field(repr=False, default_factory=dict)

    @property
    def cls(self) -> str:
        return self.data["class"]

    @property
    def reason(self) -> str:
        return self.data["reason"]

    @property
    def gpus(self) -> List[Dict]:
        return self.data["gpus"]

    @property
    def nics(self) -> List[Dict]:
        return self.data["nics"]

    @property
    def nccl_version(self) -> str:
        """The NCCL version the profile and lint are for ("2.30.7")."""
        return self.data["nccl_version"]

    @property
    def nccl_version_source(self) -> str:
        """Where :attr:`nccl_version` came from ("ncclGetVersion() of <path>",
        "given; ...", or why no libnccl was found)."""
        return self.data["nccl_version_source"]

    @property
    def nccl_library(self) -> Optional[Dict]:
        """The libnccl the version was read from: ``{"path", "version",
        "source", "reason"}`` (as :func:`strata.nccl.find`), or None when the
        version was given or no libnccl was found. Which file a process uses
        depends on how it was started (torch imported or not,
        ``STRATA_NCCL_LIBRARY``, ``LD_LIBRARY_PATH``); ``reason`` says why."""
        return self.data["nccl_library"]

    @property
    def profile(self) -> List[ProfileEntry]:
        return [ProfileEntry(p["name"], p["value"], p["reason"], p["target"], p["user_set"],
                             p.get("user_value")) for p in self.data["profile"]]

    @property
    def lint(self) -> List[Finding]:
        return [_finding(f) for f in self.data["lint"]]

    def matrix(self) -> Dict[str, Dict[str, str]]:
        """``{"GPU0": {"GPU1": "NV18", ...}, ...}``."""
        labels, cells = self.data["matrix"]["labels"], self.data["matrix"]["cells"]
        return {a: dict(zip(labels, row)) for a, row in zip(labels, cells)}

    def text(self) -> str:
        """The readable report strata-topo prints."""
        return _strata._topology_report(self._options, "text")

    def export(self, fmt: str = "env") -> str:
        """The profile as ``export`` lines ("env") or an nccl.conf ("conf")."""
        return _strata._topology_report(self._options, fmt)


def _finding(f: Dict) -> Finding:
    return Finding(f["name"], f["value"], f["severity"], f["message"], f["fix"], f["rule"],
                   f["origin"])


def _options(sysfs_root, nvidia_smi, xml, use_nvml, scope, nccl_version, env, files,
             read_conf_files, home_dir, system_conf):
    o = {"use_nvml": use_nvml, "scope": scope, "read_conf_files": read_conf_files,
         "lint_files": [str(f) for f in files]}
    for key, value in (("sysfs_root", sysfs_root), ("from_nvidia_smi", nvidia_smi),
                       ("from_xml", xml), ("nccl_version", nccl_version),
                       ("home_dir", home_dir), ("system_conf", system_conf)):
        if value is not None:
            o[key] = str(value)
    if env is not None:
        o["env"] = {str(k): str(v) for k, v in env.items()}
    return o


def detect(sysfs_root=None, *, nvidia_smi=None, xml=None, use_nvml: Optional[bool] = None,
           scope: str = "auto", nccl_version: Optional[str] = None,
           env: Optional[Dict[str, str]] = None, files: Iterable[str] = (),
           read_conf_files: bool = True) -> TopologyReport:
    """Detects the topology (or reads ``nvidia_smi`` / ``xml`` files), classifies
    it, derives the NCCL profile and lints the NCCL settings in force.

    With ``sysfs_root`` and ``nvidia_smi`` both given, PCIe and NICs come from the
    tree and GPU links from the text. ``env`` replaces ``os.environ`` for the lint;
    ``nccl_version`` ("2.28.9") defaults to the libnccl this process uses (by
    the NCCL backend's rule: torch's when torch is imported), which
    :attr:`TopologyReport.nccl_library` names with the reason.
    """
    o = _options(sysfs_root, None, xml, use_nvml, scope, nccl_version, env, files,
                 read_conf_files, None, None)
    if nvidia_smi is not None:
        if sysfs_root is not None:
            with open(nvidia_smi) as f:
                o["nvidia_smi_text"] = f.read()
        else:
            o["from_nvidia_smi"] = str(nvidia_smi)
    return TopologyReport(json.loads(_strata._topology_report(o, "json")), o)


def lint(env: Optional[Dict[str, str]] = None, *, files: Iterable[str] = (),
         nccl_version: Optional[str] = None, read_conf_files: Optional[bool] = None,
         sysfs_root=None, use_nvml: Optional[bool] = None, home_dir=None,
         system_conf=None) -> List[Finding]:
    """Lints NCCL settings: ``env`` (default ``os.environ``), the ``files``
    (export lines or nccl.conf) and NCCL's own files (NCCL_CONF_FILE or
    ~/.nccl.conf, then /etc/nccl.conf; by default read only when ``env`` is the
    process environment). Contradictions with the machine are checked against
    the detected topology. Errors come first.
    """
    if read_conf_files is None:
        read_conf_files = env is None
    if use_nvml is None:
        use_nvml = sysfs_root is None
    o = _options(sysfs_root, None, None, use_nvml, "auto", nccl_version, env, files,
                 read_conf_files, home_dir, system_conf)
    data = json.loads(_strata._topology_report(o, "json"))
    return [_finding(f) for f in data["lint"]]


def check_consistency(group, env: Optional[Dict[str, str]] = None, *,
                      ignore: Iterable[str] = (), timeout: float = 60.0) -> Dict:
    """Collective over ``group`` (e.g. ``world.group()``): every rank hashes
    its effective NCCL settings (``env``, default ``os.environ``, plus NCCL's
    configuration files); ranks that differ are reported with the variables
    that differ. O(N) traffic: two small all-reduces when all agree.

    Returns ``{"consistent": bool, "groups": [[ranks], ...] (reference
    first), "differences": [{"name", "values"}], "text": str}``, the same
    on every rank. Variables in ``ignore`` may differ (e.g. per-rank device
    lists).
    """
    return _strata._check_nccl_consistency(group, env, list(ignore), float(timeout))
