"""A guard for unattended runs: keep the machine awake while it trains, and say when it runs on
battery or the GPU slows itself down (issue 15 item 5).

`RunGuard` is a context manager around a run:

    with RunGuard("training run-20261201") as guard:
        log(guard.note)                 # what the sleep inhibitor did, or why it could not
        ... every few steps: for w in guard.check(): log(w, "warning")

- Sleep: Linux holds a `systemd-inhibit` lock (a child process that exits when its stdin closes,
  so the lock goes with this process even if it is killed), else the desktop's
  org.freedesktop.ScreenSaver inhibitor over D-Bus when `jeepney` is installed; Windows calls
  `SetThreadExecutionState`; macOS runs `caffeinate -i -w <pid>`. The lock is released when the
  block ends. Nothing here ever fails a run: where no inhibitor works, the note says why.
- Battery: /sys/class/power_supply on Linux (the root is a parameter, so tests read a made-up
  tree of real files), else psutil's sensors_battery when it knows.
- Throttling: NVML's clock event reasons (thermal, power cap, power brake) when `pynvml` is
  installed; `describe_clock_reasons(mask)` turns the bits into words.

`check()` reports a condition once when it starts, and again only after it has cleared.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

POWER_SUPPLY_ROOT = Path("/sys/class/power_supply")
WHO = "Tunesmith"
# systemd-inhibit fails at once when there is no logind / system bus (containers, WSL); a lock
# that is still held after this long was granted.
INHIBIT_SETTLE_S = 0.3

# NVML clock event reason bits (nvml.h: nvmlClocksEventReason*), used when pynvml lacks the names.
_SW_POWER_CAP = 0x4
_HW_SLOWDOWN = 0x8
_SW_THERMAL = 0x20
_HW_THERMAL = 0x40
_HW_POWER_BRAKE = 0x80
_REASONS = (
    (_SW_THERMAL, "thermal", "the driver lowers clocks to cool the GPU (software thermal slowdown)"),
    (_HW_THERMAL, "thermal", "the GPU is too hot and slows itself down (hardware thermal slowdown)"),
    (_SW_POWER_CAP, "power", "the GPU is at its power limit (software power cap)"),
    (_HW_POWER_BRAKE, "power", "the power supply asked the GPU to slow down (hardware power brake)"),
    (_HW_SLOWDOWN, "slowdown", "the GPU slows itself down (hardware slowdown: heat or power)"),
)


# -- sleep inhibitors --------------------------------------------------------------------------


@dataclass
class Inhibitor:
    """One held sleep lock (or none): `method` is what holds it, `note` says what happened."""

    method: str  # "systemd-inhibit", "dbus", "SetThreadExecutionState", "caffeinate" or "none"
    note: str
    _process: subprocess.Popen | None = None
    _release: object = None  # a callable that drops a D-Bus or Windows lock

    @property
    def held(self) -> bool:
        return self.method != "none"

    def release(self) -> None:
        proc, self._process = self._process, None
        if proc is not None:
            try:
                if proc.stdin:
                    proc.stdin.close()  # systemd-inhibit's child (cat) ends on EOF
                proc.terminate()
                proc.wait(timeout=5)
            except Exception:  # already gone, or will go when this process does
                pass
        release, self._release = self._release, None
        if callable(release):
            try:
                release()
            except Exception:  # the session bus went away: the lock went with it
                pass


def _systemd_inhibit(why: str) -> Inhibitor:
    exe = shutil.which("systemd-inhibit")
    if exe is None:
        return Inhibitor("none", "systemd-inhibit not found")
    # Its messages go to a file, not a pipe: a pipe nobody reads after the start could fill or
    # break and take the lock down with it.
    with tempfile.TemporaryFile() as err:
        try:
            # `cat` reads a pipe only this process holds: if this process dies, the pipe closes,
            # cat exits and the lock is released, so a crashed run never keeps the machine awake.
            proc = subprocess.Popen(
                [exe, "--what=sleep:idle", f"--who={WHO}", f"--why={why}", "--mode=block", "cat"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        except OSError as exc:
            return Inhibitor("none", f"systemd-inhibit could not start: {exc}")
        try:
            rc = proc.wait(timeout=INHIBIT_SETTLE_S)
        except subprocess.TimeoutExpired:
            return Inhibitor(
                "systemd-inhibit", "sleep and idle are inhibited while the run trains (systemd-inhibit)", proc
            )
        if proc.stdin:
            proc.stdin.close()
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
    return Inhibitor("none", f"systemd-inhibit refused (exit {rc}): {lines[-1] if lines else 'no message'}")


def _dbus_screensaver(why: str) -> Inhibitor:
    """The desktop session's inhibitor; held for as long as the connection stays open."""
    try:
        from jeepney import DBusAddress, new_method_call
        from jeepney.io.blocking import open_dbus_connection
    except ImportError:
        return Inhibitor("none", "jeepney not installed (no D-Bus inhibitor)")
    try:
        conn = open_dbus_connection(bus="SESSION")
        addr = DBusAddress(
            "/org/freedesktop/ScreenSaver",
            bus_name="org.freedesktop.ScreenSaver",
            interface="org.freedesktop.ScreenSaver",
        )
        cookie = conn.send_and_get_reply(new_method_call(addr, "Inhibit", "ss", (WHO, why)), timeout=2).body[0]
    except Exception as exc:  # no session bus, no screensaver service
        return Inhibitor("none", f"D-Bus inhibitor unavailable: {type(exc).__name__}: {exc}")

    def release() -> None:
        try:
            conn.send_and_get_reply(new_method_call(addr, "UnInhibit", "u", (cookie,)), timeout=2)
        finally:
            conn.close()

    return Inhibitor(
        "dbus", "idle sleep is inhibited while the run trains (org.freedesktop.ScreenSaver)", None, release
    )


def _windows(why: str) -> Inhibitor:
    import ctypes

    es_continuous, es_system_required = 0x80000000, 0x00000001
    try:
        kernel32 = ctypes.windll.kernel32  # type: ignore[attr-defined]
        if not kernel32.SetThreadExecutionState(es_continuous | es_system_required):
            return Inhibitor("none", "SetThreadExecutionState refused")
    except Exception as exc:
        return Inhibitor("none", f"SetThreadExecutionState unavailable: {exc}")

    # The state belongs to the calling thread: release it from the thread that entered the guard
    # (the training thread), which is where __exit__ runs.
    def release() -> None:
        kernel32.SetThreadExecutionState(es_continuous)

    return Inhibitor("SetThreadExecutionState", "system sleep is held off while the run trains", None, release)


def _caffeinate(why: str) -> Inhibitor:
    exe = shutil.which("caffeinate")
    if exe is None:
        return Inhibitor("none", "caffeinate not found")
    try:
        # -w: caffeinate exits with this process, so a crash never leaves the Mac awake.
        proc = subprocess.Popen(
            [exe, "-i", "-w", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    except OSError as exc:
        return Inhibitor("none", f"caffeinate could not start: {exc}")
    return Inhibitor("caffeinate", "idle sleep is held off while the run trains (caffeinate)", proc)


def inhibit_sleep(why: str, system: str | None = None) -> Inhibitor:
    """Take a sleep lock for this process; never raises. `system` is platform.system() unless
    given. On Linux the systemd lock is tried first (it also covers lid-close policies that ask
    logind), then the desktop's D-Bus inhibitor."""
    system = system or platform.system()
    try:
        if system == "Linux":
            tried = []
            for attempt in (_systemd_inhibit, _dbus_screensaver):
                lock = attempt(why)
                if lock.held:
                    return lock
                tried.append(lock.note)
            return Inhibitor("none", "the machine may sleep during the run: " + "; ".join(tried))
        if system == "Windows":
            return _windows(why)
        if system == "Darwin":
            return _caffeinate(why)
    except Exception as exc:  # a guard must never be the reason a run fails
        return Inhibitor("none", f"the machine may sleep during the run: {type(exc).__name__}: {exc}")
    return Inhibitor("none", f"the machine may sleep during the run: no sleep inhibitor known on {system}")


# What a person can do where no lock can be taken, per platform.system().
_KEEP_AWAKE = {
    "Linux": "turn automatic suspend off in the system's power settings while a run trains",
    "Darwin": "turn sleep off in System Settings > Energy (or Battery) while a run trains",
    "Windows": "set Sleep to Never in Settings > System > Power while a run trains",
}


def sleep_sentence(lock: Inhibitor, system: str | None = None) -> str:
    """What to tell a person about sleep during a run, in plain words: the held lock's note, or that
    the machine may go to sleep and how to prevent it. The tools' own errors (a D-Bus 'Failed to
    connect to bus', a missing systemd-inhibit) stay in `lock.note`: they mean nothing to a user."""
    if lock.held:
        return lock.note
    how = _KEEP_AWAKE.get(system or platform.system(), "turn automatic sleep off while a run trains")
    return f"This machine may go to sleep during a run: Tunesmith cannot keep it awake here. To prevent it, {how}."


_checked: dict[str, str | None] = {}


def sleep_lock_problem(system: str | None = None) -> str | None:
    """None when a sleep lock can be taken on this machine (it is taken and given back at once),
    else `sleep_sentence`'s plain words. Asked once per process and platform (the Hardware page
    says it once); takes up to INHIBIT_SETTLE_S."""
    key = system or platform.system()
    if key not in _checked:
        lock = inhibit_sleep("checking that a run can keep the machine awake", key)
        lock.release()
        _checked[key] = None if lock.held else sleep_sentence(lock, key)
    return _checked[key]


# -- battery -----------------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def battery_state(root: Path | str = POWER_SUPPLY_ROOT) -> tuple[bool, int | None] | None:
    """(on battery, charge %) from a Linux power_supply tree, or None when it shows no battery.

    On battery: a battery reports "Discharging", or there are mains/USB-PD adapters and none is
    online. A desktop (no battery) and a tree that cannot be read give None.
    """
    root = Path(root)
    try:
        supplies = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return None
    batteries, adapters = [], []
    for s in supplies:
        kind = _read(s / "type")
        if kind == "Battery":
            # Some peripherals (a mouse) report a battery with scope Device: not the machine's.
            if _read(s / "scope") == "Device":
                continue
            batteries.append(s)
        elif kind in ("Mains", "USB", "USB_C", "USB_PD"):
            adapters.append(s)
    if not batteries:
        return None
    discharging = any(_read(b / "status") == "Discharging" for b in batteries)
    online = [_read(a / "online") for a in adapters]
    unplugged = bool(online) and all(v == "0" for v in online)
    levels = [int(v) for v in (_read(b / "capacity") for b in batteries) if v and v.isdigit()]
    return discharging or unplugged, (min(levels) if levels else None)


def battery_warning(root: Path | str = POWER_SUPPLY_ROOT) -> str | None:
    """A sentence when the machine runs on battery, else None (psutil is asked where the
    power_supply tree does not exist, e.g. Windows and macOS)."""
    state = battery_state(root)
    if state is None and not Path(root).exists():
        try:
            import psutil

            b = psutil.sensors_battery()
        except Exception:  # no psutil, or no battery API on this system
            b = None
        if b is not None:
            state = (not b.power_plugged, int(b.percent) if b.percent is not None else None)
    if not state or not state[0]:
        return None
    level = f" ({state[1]}% left)" if state[1] is not None else ""
    return (
        f"running on battery{level}: the GPU slows down on battery and the laptop may sleep or shut "
        "down before the run ends; plug it in"
    )


# -- GPU throttling ----------------------------------------------------------------------------


def describe_clock_reasons(mask: int) -> list[str]:
    """The thermal / power reasons in an NVML clock event reasons mask, as sentences (idle,
    application clocks and sync boost are normal and not reported)."""
    out = []
    for bit, _, text in _REASONS:
        if mask & bit:
            out.append(text)
    return out


def throttle_mask(index: int = 0) -> int | None:
    """NVML's current clock event reasons of GPU `index`, or None without pynvml / NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
                pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons"
            )
            return int(get(handle))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVIDIA driver, or a GPU that does not report reasons
        return None


# -- the guard ---------------------------------------------------------------------------------


@dataclass
class RunGuard:
    """Sleep lock for the length of a `with` block, and `check()` for the warnings of the moment."""

    why: str = "training a model"
    power_supply_root: Path | str = POWER_SUPPLY_ROOT
    gpu_index: int | None = 0  # None: do not ask NVML
    system: str | None = None  # platform.system() unless given
    min_check_interval_s: float = 30.0  # NVML and sysfs are cheap, but not every step
    inhibitor: Inhibitor | None = field(default=None, init=False)
    _active: set[str] = field(default_factory=set, init=False)
    _last_check: float = field(default=float("-inf"), init=False)

    @property
    def note(self) -> str:
        """The sleep lock in plain words (what the run logs once); the tools' errors are in
        `inhibitor.note`."""
        return sleep_sentence(self.inhibitor, self.system) if self.inhibitor else "not started"

    def __enter__(self) -> RunGuard:
        self.inhibitor = inhibit_sleep(self.why, self.system)
        return self

    def __exit__(self, *exc) -> None:
        if self.inhibitor is not None:
            self.inhibitor.release()

    def conditions(self) -> dict[str, str]:
        """{condition: sentence} for what holds now: battery, and each throttling reason."""
        now: dict[str, str] = {}
        battery = battery_warning(self.power_supply_root)
        if battery:
            now["battery"] = battery
        mask = throttle_mask(self.gpu_index) if self.gpu_index is not None else None
        if mask:
            for bit, kind, text in _REASONS:
                if mask & bit:
                    now[f"{kind}:{bit}"] = f"GPU throttled: {text}; steps will be slower"
        return now

    def check(self, force: bool = False) -> list[str]:
        """Warnings for conditions that started since the last check (each once, until it
        clears); at most one look every `min_check_interval_s` unless forced."""
        t = time.monotonic()
        if not force and t - self._last_check < self.min_check_interval_s:
            return []
        self._last_check = t
        now = self.conditions()
        new = [text for key, text in now.items() if key not in self._active]
        self._active = set(now)
        return new
