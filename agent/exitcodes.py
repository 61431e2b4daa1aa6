"""The exit statuses of the ``rewarm`` command, one per kind of failure.

Codes above 2 follow BSD's sysexits.h (``EX_*``), so that scripts and systemd's
``RestartPreventExitStatus=`` can tell a retryable refusal from a broken configuration:

====  ==============  ===========================================================
code  name            when
====  ==============  ===========================================================
0     OK              done
1     FAILURE         any other typed failure (a golden mismatch at build, a server's 500)
2     USAGE           bad command line (argparse's own code; also inconsistent flags)
65    EX_DATAERR      bad input data: a corrupt snapshot, a malformed checkpoint or trace,
                      a request a server answered 400 or 413 (no retry makes it valid)
66    EX_NOINPUT      an input file or snapshot named on the command line does not exist
69    EX_UNAVAILABLE  a service did not answer: node agent, front door, Consul, Nomad
74    EX_IOERR        reading or writing a local file failed (disk full, permission)
75    EX_TEMPFAIL     a server refused the request: 429 overloaded, 503 no capacity,
                      504 deadline, 409 not allowed now, 404 no such model or replica
77    EX_NOPERM       a server refused the credentials (401, Consul/Nomad ACL 403)
78    EX_CONFIG       this command's configuration is wrong (a flag value, environment,
                      a port in use or an address not of this host, a model directory
                      that is not one); systemd's RestartPreventExitStatus=78 in jobs/systemd/
                      stops a unit restarting on it
130   INTERRUPTED     Ctrl-C / SIGTERM during a foreground command
141   BROKEN_PIPE     the reader of stdout went away (``| head``)
====  ==============  ===========================================================
"""

from __future__ import annotations

import errno

from agent.errors import (AclDenied, ConfigError, InvalidCheckpoint, InvalidTrace,
                          ProtocolError, SnapshotError, Unauthorized)

OK, FAILURE, USAGE = 0, 1, 2
EX_DATAERR, EX_NOINPUT, EX_UNAVAILABLE, EX_IOERR = 65, 66, 69, 74
EX_TEMPFAIL, EX_NOPERM, EX_CONFIG = 75, 77, 78
INTERRUPTED, BROKEN_PIPE = 130, 141


def answered_by_server(exc: BaseException) -> int | None:
    """The status code a server answered with, when ``exc`` stands for such an answer
    (agent/client.py's ``error_from`` sets ``code`` on the instance, the control client
    ``status``); None for an error raised here."""
    for attr in ("status", "code"):
        value = vars(exc).get(attr) if hasattr(exc, "__dict__") else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def exit_code(exc: BaseException) -> int:
    """The exit status for a failure that ended a command (table in the module docstring)."""
    status = answered_by_server(exc)
    if status is not None:
        if status in (401, 403):
            return EX_NOPERM
        if status in (400, 413, 422):     # the request itself: over the context, a bad field
            return EX_DATAERR
        return FAILURE if status == 500 else EX_TEMPFAIL
    if isinstance(exc, (Unauthorized, AclDenied, PermissionError)):
        return EX_NOPERM
    if isinstance(exc, ConnectionError):       # Unreachable, ClusterError, ECONNREFUSED
        return EX_UNAVAILABLE
    if isinstance(exc, TimeoutError):
        return EX_UNAVAILABLE
    if isinstance(exc, ConfigError):
        return EX_CONFIG
    if isinstance(exc, FileNotFoundError):
        return EX_NOINPUT
    if isinstance(exc, (SnapshotError, InvalidCheckpoint, InvalidTrace, ProtocolError)) \
            and not isinstance(exc, OSError):
        return EX_DATAERR
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return EX_CONFIG                       # a port in use: the units' RestartPreventExitStatus
    if isinstance(exc, OSError):
        return EX_IOERR
    return FAILURE
