#!/usr/bin/env python3
"""Let a virtual environment see the packages of the Python that made it, when that Python is itself a venv.

`make setup` builds .venv with ``python3 -m venv --system-site-packages`` so that .venv sees the base image's
torch. But "system" means the base *installation*: when python3 is itself a virtual environment (AMD's
rocm/primus images keep torch and ROCm's Python wheels in the venv /opt/venv), .venv sees /usr's packages, not
/opt/venv's, and pip then looks for ``torch==<the image's ROCm build>`` on PyPI and the build fails. This adds a
``.pth`` file to VENV that adds the making environment's site-packages (and runs their own .pth files) after
VENV's, as --system-site-packages does for a base installation. Where python3 is no venv (NGC's image) there is
nothing to do. Run it with the Python that made VENV:

    python3 -m venv --system-site-packages .venv && python3 docker/inherit_base_packages.py .venv
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

PTH = "_inherit_base_packages.pth"


def making_environment_site_packages() -> list[str]:
    """This interpreter's site-packages when it runs in a virtual environment, else none (--system-site-packages
    suffices)."""
    return site.getsitepackages() if sys.prefix != sys.base_prefix else []


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {Path(argv[0]).name} VENV (a virtual environment this Python made)", file=sys.stderr)
        return 2
    python = Path(argv[1]) / "bin" / "python"
    if not python.exists():
        print(f"{python} does not exist: make it first with `{sys.executable} -m venv --system-site-packages "
              f"{argv[1]}`", file=sys.stderr)
        return 2
    dirs = making_environment_site_packages()
    if not dirs:
        print(f"{sys.prefix} is no virtual environment: --system-site-packages already shows its packages")
        return 0
    probe = "import sys, sysconfig; print(sysconfig.get_path('purelib')); print('%d.%d' % sys.version_info[:2])"
    purelib, version = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                                      check=True).stdout.split()
    if version != "%d.%d" % sys.version_info[:2]:
        print(f"{python} runs Python {version}, this is {sys.version_info[0]}.{sys.version_info[1]}: their packages "
              "cannot be shared", file=sys.stderr)
        return 2
    # one line: a .pth line that starts with `import` is executed, so site.addsitedir also runs their .pth files
    (Path(purelib) / PTH).write_text("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
    print(f"{argv[1]} now also sees {', '.join(dirs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
