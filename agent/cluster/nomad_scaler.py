"""Scaling through Nomad (python-nomad): a :class:`agent.cluster.base.Scaler`.

python-nomad 2.1 has no scale helper, so ``set_target`` posts ``/v1/job/<job>/scale``
through its generic ``request`` with ``Count``, ``Target {Group}``, ``Message`` and
``Meta``; ``target`` reads ``GET /v1/job/<job>/scale`` (the group's ``Desired``). Outcomes
(Nomad "Jobs HTTP API", Scale Task Group):

- 400 while a deployment is active: :class:`~agent.errors.ClusterError`, ``retryable``; the
  caller keeps its old target and asks again next tick;
- other 400s (count outside the job's ``scaling`` min/max): ClusterError, not retryable;
- 401/403: :class:`~agent.errors.AclDenied` through an :class:`~agent.cluster.acl.AclGate`:
  logged once per change, no request for ``acl_backoff_s`` (a denied token is not fixed by
  asking every tick);
- 404: the model's job does not exist yet: ``register_job(model)`` (Nomad parses the HCL
  in ``jobs/``, :func:`agent.cluster.jobs.replica_job`) is registered, then scaled.  A job
  Nomad refuses - 400 from the parser, or 500 whose text is Nomad's validation multierror
  ("1 error occurred: ..."; ``Job.Register`` answers validation errors with 500) - is a
  permanent :class:`~agent.errors.ClusterError` naming the registration (``POST /v1/jobs``):
  logged once, and answered from memory for ``job_error_backoff_s`` without a request (the
  HCL will not fix itself between ticks); any other 5xx of the registration is retryable;
- 429, 5xx and transport errors: back off (exponential, full jitter between half and all
  of the step, capped; at least the server's ``Retry-After``, itself bounded), raising a
  retryable ClusterError with ``retry_after_s`` until the back-off ends.

Model names are checked (:func:`agent.cluster.jobs.check_model`) before a URL is built.
``set_target`` calls for one model are serialised by a per-model lock.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from collections.abc import Callable

import nomad
import nomad.api.exceptions as nexc

from agent.clock import Clock, SystemClock
from agent.cluster.acl import ACL_BACKOFF_S, AclGate
from agent.cluster.jobs import check_model
from agent.cluster.nomad_http import cause_of, nomad_client, nomad_error  # noqa: F401
from agent.errors import AclDenied, ClusterError

log = logging.getLogger(__name__)

JOB_PREFIX = "rewarm-replica-"
GROUP = "replica"
JOB_ERROR_BACKOFF_S = 300.0
_VALIDATION = re.compile(r"^\d+ errors? occurred:")   # go-multierror, Job.Validate's text


class NomadScaler:
    """Keeps each model's replica job at its target count. Thread-safe."""

    def __init__(self, client: nomad.Nomad, *, register_job: Callable[[str], dict],
                 clock: Clock | None = None, job_prefix: str = JOB_PREFIX, group: str = GROUP,
                 backoff_base_s: float = 1.0, backoff_cap_s: float = 60.0,
                 acl_backoff_s: float = ACL_BACKOFF_S, rng: random.Random | None = None,
                 job_error_backoff_s: float = JOB_ERROR_BACKOFF_S) -> None:
        self._n = client
        self._job = register_job
        self._clock = clock or SystemClock()
        self._prefix = job_prefix
        self._group = group
        self._base, self._cap = backoff_base_s, backoff_cap_s
        self._rng = rng or random.Random()
        self._targets: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.acl = AclGate("nomad", clock=self._clock, backoff_s=acl_backoff_s)
        self.job_error_backoff_s = job_error_backoff_s
        self._job_errors: dict[str, tuple[ClusterError, float]] = {}   # model -> (error, at)

    def job_id(self, model: str) -> str:
        return self._prefix + check_model(model)

    def _lock(self, model: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(model, threading.Lock())

    def set_target(self, model: str, count: int, *, reason: str) -> None:
        """POST the scale request; raises ClusterError/AclDenied as described above."""
        job = self.job_id(model)
        with self._lock(model):
            self._set_target(model, job, int(count), reason)

    def _set_target(self, model: str, job: str, count: int, reason: str) -> None:
        self.acl.check()
        now = self._clock.now()
        held = self._job_errors.get(model)
        if held is not None and now - held[1] < self.job_error_backoff_s:
            raise held[0]
        if now < self._retry_at.get(model, 0.0):
            wait = self._retry_at[model] - now
            raise ClusterError(f"nomad: backing off {wait:.1f}s before scaling {model}",
                               service="nomad", status=None, retryable=True, retry_after_s=wait)
        endpoint = f"/v1/job/{job}/scale"
        body = {"Count": count, "Target": {"Group": self._group}, "Message": reason[:256],
                "Meta": {"rewarm.model": model, "rewarm.reason": reason[:256]}}
        try:
            try:
                self._n.job.request(job, "scale", method="post", json=body)
            except nexc.URLNotFoundNomadException:
                log.info("nomad: job %s not found; registering it from jobs/", job)
                self._register(model, job, now)
                self._n.job.request(job, "scale", method="post", json=body)
        except nexc.BadRequestNomadException as exc:
            text = cause_of(exc)
            active = "deployment" in text.lower()
            raise ClusterError(f"nomad: {endpoint} refused count={count}: {text}"
                               + ("; retrying next tick" if active else ""),
                               service="nomad", status=400, endpoint=endpoint,
                               retryable=active) from exc
        except nexc.BaseNomadException as exc:
            err = nomad_error(exc, endpoint, "the scale-job, submit-job and parse-job "
                                             "capabilities")
            if isinstance(err, AclDenied):
                self.acl.denied(err)
                raise err from exc
            if not err.retryable:
                raise err from exc
            wait = self._back_off(model, now, err.retry_after_s)
            raise ClusterError(f"{err.message}; backing off {wait:.2f}s", service="nomad",
                               status=err.status, endpoint=endpoint, retryable=True,
                               retry_after_s=wait) from exc
        self.acl.ok()
        self._failures.pop(model, None)
        self._retry_at.pop(model, None)
        self._targets[model] = count

    def _register(self, model: str, job: str, now: float) -> None:
        """Parse and register the model's job; a refusal Nomad will repeat is held."""
        endpoint = "/v1/jobs"
        try:
            spec = self._job(model)
            self._n.jobs.register_job({"Job": spec})
            return
        except nexc.BaseNomadException as exc:
            err = nomad_error(exc, endpoint, "the submit-job capability")
            text = cause_of(exc)
            if isinstance(err, AclDenied) or not (
                    err.status is not None and err.status < 500 or _VALIDATION.match(text)):
                raise           # the caller's ACL gate or back-off handles it
            err = ClusterError(f"nomad: registering job {job} (POST {endpoint}) was refused "
                               f"({err.status}): {text}", service="nomad",
                               status=err.status, endpoint=endpoint, retryable=False)
        except ClusterError as exc:
            if isinstance(exc, AclDenied):
                self.acl.denied(exc)
                raise
            if exc.retryable:
                wait = self._back_off(model, now, exc.retry_after_s)
                raise ClusterError(f"{exc.message}; backing off {wait:.2f}s", service="nomad",
                                   status=exc.status, endpoint=getattr(exc, "endpoint", None),
                                   retryable=True, retry_after_s=wait) from exc
            err = ClusterError(f"nomad: registering job {job} failed: Nomad's parser refused "
                               f"jobs/ HCL: {exc}", service="nomad", status=exc.status,
                               endpoint=getattr(exc, "endpoint", None), retryable=False)
        log.error("%s; not registering %s again for %.0f s", err, job, self.job_error_backoff_s)
        self._job_errors[model] = (err, now)
        raise err

    def _back_off(self, model: str, now: float, retry_after_s: float | None) -> float:
        n = self._failures.get(model, 0)
        self._failures[model] = n + 1
        step = min(self._cap, self._base * (2 ** n))
        wait = max(step * self._rng.uniform(0.5, 1.0), retry_after_s or 0.0)
        self._retry_at[model] = now + wait
        return wait

    def target(self, model: str) -> int:
        """The group's desired count in Nomad (0 when the job does not exist yet); the last
        target set when Nomad cannot be read."""
        job = self.job_id(model)
        try:
            status = self._n.job.request(job, "scale", method="get").json()
            return int(status["TaskGroups"][self._group]["Desired"])
        except nexc.URLNotFoundNomadException:
            return 0
        except (nexc.BaseNomadException, KeyError, ValueError, TypeError) as exc:
            log.warning("nomad: cannot read scale status of %s: %s", model, exc)
            return self._targets.get(model, 0)
