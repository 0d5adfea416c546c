"""Bash code contexts: ``run_code(code, language="bash")`` as a persistent shell.

Each cell runs in a fresh ``bash`` process (so a timeout, an interrupt or an ``exit``
in the cell ends only that cell), and what makes a shell session feel continuous is
carried from one cell to the next through a state file in the sandbox's ``/tmp``:
shell variables (exported or not, arrays included), functions, aliases and the working
directory. Options (``set -e``), traps and background jobs do not carry over.

Per-call ``envs`` apply to that cell only: they override the saved state for that cell,
and the next cell sees what the variable was before (or no variable).

stdout and stderr are the kernel's own file descriptors, so output streams like any
other cell's; a non-zero exit status is the cell's error (``ExitCodeError``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from typing import Dict, Optional

# Names bash owns or that describe the process, never restored into the next cell.
_SKIP = (
    "BASH*|EUID|UID|PPID|SHELLOPTS|FUNCNAME|GROUPS|RANDOM|SRANDOM|SECONDS|LINENO|"
    "HISTCMD|PIPESTATUS|DIRSTACK|EPOCHREALTIME|EPOCHSECONDS|PWD|OLDPWD|SHLVL|_|"
    "COLUMNS|LINES|OPTIND|OPTERR|OPTARG|IFS|PS1|PS2|PS4|HOSTNAME|HOSTTYPE|MACHTYPE|"
    "OSTYPE|COMP_WORDBREAKS|MAILCHECK"
)

# $1: the state file, $2: the cell's code, $3: the per-call env names (space-separated),
# $4: their assignments (quoted by Python). The state is saved on any way out (EXIT trap),
# atomically (a cell killed mid-save leaves the previous state).
_WRAPPER = (
    """
__sandlot_state=$1 __sandlot_cell=$2 __sandlot_skip=" $3 "
__sandlot_save() {
    local __sandlot_rc=$? __sandlot_n
    {
        for __sandlot_n in $(compgen -v); do
            case $__sandlot_n in __sandlot_*|%s) continue ;; esac
            case $__sandlot_skip in *" $__sandlot_n "*) continue ;; esac
            declare -p "$__sandlot_n" 2>/dev/null
        done
        printf '%%s\n' "$__sandlot_kept"
        declare -f
        alias -p
        printf 'cd -- %%q 2>/dev/null\\n' "$PWD"
    } > "$__sandlot_state.new" 2>/dev/null && mv -f "$__sandlot_state.new" "$__sandlot_state"
    return $__sandlot_rc
}
trap __sandlot_save EXIT
shopt -s expand_aliases
for __sandlot_n in $3; do unset "$__sandlot_n"; done
if [ -s "$__sandlot_state" ]; then . "$__sandlot_state"; fi
__sandlot_kept=$(for __sandlot_n in $3; do declare -p "$__sandlot_n" 2>/dev/null; done)
eval "$4"
. "$__sandlot_cell"
"""
    % _SKIP
)


class BashSession:
    """The state of one bash context (lives in the context's kernel process)."""

    def __init__(self) -> None:
        self.state: Optional[str] = None

    def run(self, code: str, envs: Dict[str, str]) -> int:
        """Run one cell; bash's exit status (-N: bash was killed by signal N)."""
        bash = shutil.which("bash")
        if bash is None:
            raise FileNotFoundError("bash is not installed in this sandbox's template")
        if self.state is None:
            handle, self.state = tempfile.mkstemp(prefix="sandlot-bash-", suffix=".state")
            os.close(handle)
        handle, cell = tempfile.mkstemp(prefix="sandlot-bash-", suffix=".cell")
        try:
            with os.fdopen(handle, "w", encoding="utf-8", errors="surrogateescape") as out:
                out.write(code)
                if not code.endswith("\n"):
                    out.write("\n")
            exports = "".join(
                "export %s=%s\n" % (name, shlex.quote(value)) for name, value in envs.items()
            )
            argv = [bash, "-c", _WRAPPER, "bash", self.state, cell, " ".join(envs), exports]
            # call() kills the child if an interrupt or a timeout lands while it waits.
            status = subprocess.call(argv)
        finally:
            os.unlink(cell)
        return status
