"""A folder the process under test cannot write, for the tests of the read-only / no-permission
refusals (issue 28 item 7). chmod 0o555 binds only for a process without root's DAC override: as
root, the process under test is a child started through setpriv with CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH dropped from its bounding set, so the permission bits bind for it as for any
user; where that is not possible the test is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

_DROP = "-dac_override,-dac_read_search"


def ordinary_user_prefix() -> list[str]:
    """The command prefix that runs a child as an ordinary user would be refused (empty when this
    process is not root); skips the test where no such child can be started."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: chmod does not bind")
    prefix = [setpriv, "--bounding-set", _DROP, "--inh-caps", _DROP]
    probe = subprocess.run([*prefix, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and setpriv cannot drop the DAC override: {probe.stderr!r}")
    return prefix
