"""Scaling through Nomad (python-nomad): a :class:`agent.cluster.base.Scaler`.

python-nomad 2.1 has no scale helper, so ``set_target`` posts
``/v1/job/<job>/scale`` through its generic ``request`` with ``Count``, ``Target {Group}``,
``Message`` and ``Meta``; ``target`` reads ``GET /v1/job/<job>/scale`` (the group's
``Desired``). Outcomes (Nomad HTTP API, "Scale Task Group"):

- 400 while a deployment is active: :class:`~agent.errors.ClusterError` with
  ``retryable=True``; the predictor keeps its old target and asks again next tick;
- other 400s (count outside the job's ``scaling`` min/max): ClusterError, not retryable;
- 403: :class:`~agent.errors.AclDenied` naming the endpoint and the capability needed;
- 404: the model's job does not exist yet: register it from the template in ``jobs/``
  (``agent.cluster.jobs.render_replica_job``) and scale again;
- 429, 5xx and transport errors: back off (exponential, full jitter between half and all
  of the step, capped), raising a retryable ClusterError with ``retry_after_s`` until the
  back-off ends.

``NOMAD_ADDR``, ``NOMAD_TOKEN``, ``NOMAD_NAMESPACE`` and ``NOMAD_REGION`` are honoured by
python-nomad itself (or given as arguments to :func:`nomad_client`).
"""

from __future__ import annotations

import logging
import random
from typing import Callable

import nomad
import nomad.api.exceptions as nexc
from nomad.api.base import Requester

from agent.clock import Clock, SystemClock
from agent.errors import AclDenied, ClusterError

log = logging.getLogger(__name__)

JOB_PREFIX = "rewarm-replica-"
GROUP = "replica"
SNAPSHOTS_META_KEY = "rewarm_snapshots"     # node metadata read by the replica job's affinity


def nomad_client(address: str | None = None, token: str | None = None,
                 namespace: str | None = None, region: str | None = None) -> nomad.Nomad:
    """A python-nomad client; unset arguments fall back to NOMAD_* environment variables."""
    return nomad.Nomad(address=address, token=token, namespace=namespace, region=region,
                       timeout=5)


class _NodeMetadata(Requester):
    """``/v1/client/metadata`` through python-nomad's own requester (no helper in 2.1)."""

    ENDPOINT = "client/metadata"


def _status(exc: Exception) -> int | None:
    resp = getattr(exc, "nomad_resp", None)
    return getattr(resp, "status_code", None)


def _text(exc: Exception) -> str:
    resp = getattr(exc, "nomad_resp", None)
    return getattr(resp, "text", None) or str(resp or exc)


class NomadScaler:
    """Keeps each model's replica job at its target count."""

    def __init__(self, client: nomad.Nomad, *, render_job: Callable[[str], dict],
                 clock: Clock | None = None, job_prefix: str = JOB_PREFIX, group: str = GROUP,
                 backoff_base_s: float = 1.0, backoff_cap_s: float = 60.0,
                 rng: random.Random | None = None) -> None:
        self._n = client
        self._render = render_job
        self._clock = clock or SystemClock()
        self._prefix = job_prefix
        self._group = group
        self._base = backoff_base_s
        self._cap = backoff_cap_s
        self._rng = rng or random.Random()
        self._targets: dict[str, int] = {}
        self._failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}

    def job_id(self, model: str) -> str:
        return self._prefix + model

    def set_target(self, model: str, count: int, *, reason: str) -> None:
        """POST the scale request; raises ClusterError/AclDenied as described above."""
        now = self._clock.now()
        if now < self._retry_at.get(model, 0.0):
            wait = self._retry_at[model] - now
            raise ClusterError(f"nomad: backing off {wait:.1f}s before scaling {model}",
                               service="nomad", status=None, retryable=True, retry_after_s=wait)
        job = self.job_id(model)
        endpoint = f"/v1/job/{job}/scale"
        body = {"Count": int(count), "Target": {"Group": self._group}, "Message": reason[:256],
                "Meta": {"rewarm.model": model, "rewarm.reason": reason[:256]}}
        try:
            try:
                self._n.job.request(job, "scale", method="post", json=body)
            except nexc.URLNotFoundNomadException:
                log.info("nomad: job %s not found; registering it from the template", job)
                self._n.jobs.register_job({"Job": self._render(model)})
                self._n.job.request(job, "scale", method="post", json=body)
        except nexc.BadRequestNomadException as exc:
            text = _text(exc)
            active = "deployment" in text.lower()
            raise ClusterError(f"nomad: {endpoint} refused count={count}: {text}"
                               + ("; retrying next tick" if active else ""),
                               service="nomad", status=400, endpoint=endpoint,
                               retryable=active) from exc
        except nexc.URLNotAuthorizedNomadException as exc:
            raise AclDenied(f"nomad: ACL token (NOMAD_TOKEN) denied {endpoint}; it needs the "
                            f"scale-job and submit-job capabilities: {_text(exc)}",
                            service="nomad", status=403, endpoint=endpoint) from exc
        except nexc.BaseNomadException as exc:
            status = _status(exc)
            if status is not None and status != 429 and status < 500:
                raise ClusterError(f"nomad: {endpoint} failed with {status}: {_text(exc)}",
                                   service="nomad", status=status, endpoint=endpoint,
                                   retryable=False) from exc
            wait = self._back_off(model, now)
            raise ClusterError(f"nomad: {endpoint} answered {status or 'no response'}; "
                               f"backing off {wait:.2f}s", service="nomad", status=status,
                               endpoint=endpoint, retryable=True, retry_after_s=wait) from exc
        self._failures.pop(model, None)
        self._retry_at.pop(model, None)
        self._targets[model] = int(count)

    def _back_off(self, model: str, now: float) -> float:
        n = self._failures.get(model, 0)
        self._failures[model] = n + 1
        step = min(self._cap, self._base * (2 ** n))
        wait = step * self._rng.uniform(0.5, 1.0)
        self._retry_at[model] = now + wait
        return wait

    def target(self, model: str) -> int:
        """The group's desired count in Nomad (0 when the job does not exist yet); the last
        target set when Nomad cannot be read."""
        try:
            status = self._n.job.request(self.job_id(model), "scale", method="get").json()
            return int(status["TaskGroups"][self._group]["Desired"])
        except nexc.URLNotFoundNomadException:
            return 0
        except (nexc.BaseNomadException, KeyError, ValueError) as exc:
            log.warning("nomad: cannot read scale status of %s: %s", model, exc)
            return self._targets.get(model, 0)

    def publish_cached_snapshots(self, models: list[str], node_id: str | None = None) -> dict:
        """:func:`publish_cached_snapshots` with this scaler's client."""
        return publish_cached_snapshots(self._n, models, node_id)


def publish_cached_snapshots(client: nomad.Nomad, models: list[str],
                             node_id: str | None = None) -> dict:
    """Set a node's dynamic metadata ``rewarm_snapshots`` to the comma-separated models it
    caches (the replica job's ``set_contains`` affinity reads it; an empty list unsets it).

    ``POST /v1/client/metadata`` (Nomad "Client HTTP API", dynamic node metadata); returns
    Nomad's answer (``Meta``, ``Dynamic``, ``Static``). Raises AclDenied (403, needs
    node:write) or ClusterError.
    """
    req = _NodeMetadata(**client.requester_settings)
    body = {"Meta": {SNAPSHOTS_META_KEY: ",".join(sorted(set(models))) or None}}
    try:
        return req.request(method="post", params={"node_id": node_id}, json=body).json()
    except nexc.URLNotAuthorizedNomadException as exc:
        raise AclDenied(f"nomad: ACL token denied /v1/client/metadata (needs node:write): "
                        f"{_text(exc)}", service="nomad", status=403,
                        endpoint="/v1/client/metadata") from exc
    except nexc.BaseNomadException as exc:
        raise ClusterError(f"nomad: /v1/client/metadata failed: {_text(exc)}",
                           service="nomad", status=_status(exc),
                           endpoint="/v1/client/metadata") from exc
