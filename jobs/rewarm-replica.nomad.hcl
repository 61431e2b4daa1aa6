# Per-model replica job template. `rewarm jobs render --model M` replaces __MODEL__ and
# __MAX__ and prints the JSON job for POST /v1/jobs. The predictor scales group "replica"
# through POST /v1/job/rewarm-replica-M/scale; count starts at 0 (scale to zero).
job "rewarm-replica-__MODEL__" {
  type        = "service"
  datacenters = ["*"]

  group "replica" {
    count = 0

    scaling {
      enabled = true
      min     = 0
      max     = __MAX__
    }

    # Prefer nodes whose agent already caches this model's snapshot (dynamic node
    # metadata "rewarm_snapshots", a comma-separated list published by the node agent).
    affinity {
      attribute = "${meta.rewarm_snapshots}"
      operator  = "set_contains"
      value     = "__MODEL__"
      weight    = 100
    }

    network {
      port "replica" {}
    }

    service {
      name     = "rewarm-replica"
      port     = "replica"
      provider = "consul"
      tags     = ["model=__MODEL__"]
    }

    task "replica" {
      driver = "raw_exec"

      # The allocation holds the GPU lease; the node agent restores into a zygote on it.
      # Stopping the allocation drains the replica.
      config {
        command = "rewarm"
        args    = ["agent", "adopt", "--model", "__MODEL__", "--port", "${NOMAD_PORT_replica}",
                   "--alloc", "${NOMAD_ALLOC_ID}"]
      }

      resources {
        cpu    = 1000
        memory = 2048

        device "nvidia/gpu" {
          count = 1
        }
      }
    }
  }
}
