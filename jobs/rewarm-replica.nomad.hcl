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

      # The allocation holds the GPU lease: it asks this node's agent to restore the model
      # on the device Nomad gave it (into a waiting zygote), then stays up; stopping the
      # allocation (SIGTERM) drains that replica through the agent.
      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          set -e
          agent="${attr.unique.network.ip-address}:7733"
          uuid=$(echo "$NVIDIA_VISIBLE_DEVICES" | cut -d, -f1)
          index=$(nvidia-smi --query-gpu=index,uuid --format=csv,noheader | grep "$uuid" | cut -d, -f1)
          r=$(rewarm agent restore __MODEL__ --agent "$agent" --device "cuda:$index" \
              | python3 -c 'import json, sys; print(json.load(sys.stdin)["replica"])')
          trap 'rewarm agent drain "$r" --agent "$agent"; exit 0' TERM INT
          while :; do sleep 3600 & wait $!; done
          EOT
        ]
      }

      # The control API's shared secret, from Nomad Variables (`nomad var put nomad/jobs
      # control_token=...`): the agent requires it beyond loopback, its clients send it.
      template {
        data        = <<-EOT
          REWARM_CONTROL_TOKEN={{ with nomadVar "nomad/jobs" }}{{ .control_token }}{{ end }}
          EOT
        destination = "secrets/control.env"
        env         = true
      }

      kill_timeout = "60s"

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
