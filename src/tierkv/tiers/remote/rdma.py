"""RDMA detection through pyverbs: devices, ports, link state and GIDs.

Used by the Mooncake backend (protocol ``rdma`` with the devices that have an
active port, ``tcp`` otherwise) and by ``tierkv info``. Never raises: when
pyverbs is missing or lists nothing, the report says why in ``reason``.

pyverbs ships as Debian's ``python3-pyverbs`` (rdma-core), built for the
system Python. When a virtual environment cannot import it and the system
copy matches this interpreter's ABI, it is loaded from there (appended last
to ``sys.path`` for the import only, so it never shadows venv packages).
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field

SYSTEM_DIST = "/usr/lib/python3/dist-packages"
_PORT_STATES = {0: "nop", 1: "down", 2: "init", 3: "armed", 4: "active", 5: "active_defer"}
_LINK_LAYERS = {0: "unspecified", 1: "infiniband", 2: "ethernet"}


@dataclass(frozen=True)
class RdmaPort:
    number: int
    state: str
    link_layer: str
    gids: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.state == "active"


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    ports: tuple[RdmaPort, ...] = ()

    @property
    def active(self) -> bool:
        return any(p.active for p in self.ports)


@dataclass(frozen=True)
class RdmaReport:
    """What this machine offers for RDMA. ``usable`` lists devices with an active port."""

    devices: tuple[RdmaDevice, ...] = ()
    reason: str = ""
    source: str = ""
    details: dict = field(default_factory=dict)

    @property
    def usable(self) -> list[str]:
        return [d.name for d in self.devices if d.active]

    def summary(self) -> str:
        """One line for ``tierkv info``."""
        if self.usable:
            return f"rdma: {', '.join(self.usable)} (via {self.source})"
        return f"rdma: none usable, TCP is used ({self.reason})"


def _import_pyverbs():
    """The pyverbs.device module, or None with the reason it could not be imported."""
    try:
        return importlib.import_module("pyverbs.device"), "", "pyverbs"
    except ImportError as exc:
        first = f"pyverbs not importable ({exc})"
    ours = sysconfig.get_config_var("EXT_SUFFIX") or ""
    pkg = os.path.join(SYSTEM_DIST, "pyverbs")
    if not os.path.isdir(pkg):
        return None, f"{first}; install it with apt-get install python3-pyverbs", ""
    if not any(name.endswith(ours) for name in os.listdir(pkg)):
        return None, f"{first}; {pkg} is built for another Python than {sys.version.split()[0]}", ""
    sys.path.append(SYSTEM_DIST)
    try:
        return importlib.import_module("pyverbs.device"), "", f"pyverbs from {SYSTEM_DIST}"
    except ImportError as exc:
        return None, f"{first}; system pyverbs failed too ({exc})", ""
    finally:
        sys.path.remove(SYSTEM_DIST)


def _gids(ctx, port: int, count: int) -> tuple[str, ...]:
    out = []
    for idx in range(min(count, 16)):
        try:
            gid = str(ctx.query_gid(port, idx))
        except Exception:  # an unpopulated GID slot raises; stop at the first
            break
        if gid and gid.strip("0:"):
            out.append(gid)
    return tuple(out)


def _device(pyverbs_device, name: str) -> RdmaDevice:
    ctx = pyverbs_device.Context(name=name)
    try:
        attr = ctx.query_device()
        ports = []
        for num in range(1, attr.phys_port_cnt + 1):
            pa = ctx.query_port(num)
            ports.append(RdmaPort(num, _PORT_STATES.get(pa.state, str(pa.state)),
                                  _LINK_LAYERS.get(pa.link_layer, str(pa.link_layer)),
                                  _gids(ctx, num, pa.gid_tbl_len)))
        return RdmaDevice(name, tuple(ports))
    finally:
        ctx.close()


def detect() -> RdmaReport:
    """List RDMA devices and their ports; never raises. Cheap enough to call at start-up."""
    mod, why, source = _import_pyverbs()
    if mod is None:
        return RdmaReport(reason=why)
    try:
        listed = mod.get_device_list()
    except Exception as exc:  # pyverbs raises when the kernel exposes no verbs devices
        return RdmaReport(reason=f"pyverbs lists no RDMA device ({exc})", source=source)
    devices, errors = [], {}
    for dev in listed:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        try:
            devices.append(_device(mod, name))
        except Exception as exc:  # a device we cannot open is reported, not fatal
            errors[name] = repr(exc)
    report = RdmaReport(tuple(devices), source=source, details=errors)
    if not report.usable:
        reason = "no RDMA device" if not devices else "no RDMA device has an active port"
        return RdmaReport(tuple(devices), reason=reason, source=source, details=errors)
    return report
