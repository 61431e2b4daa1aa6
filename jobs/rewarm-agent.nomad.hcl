# The node agent: one per GPU node (system job). It owns the snapshot cache volume, the
# zygotes and the replicas' lifecycle, and publishes cached snapshots as node metadata.
job "rewarm-agent" {
  type        = "system"
  datacenters = ["*"]

  constraint {
    attribute = "${node.class}"
    value     = "gpu"
  }

  group "agent" {
    volume "snapshots" {
      type      = "host"
      source    = "rewarm-snapshots"
      read_only = false
    }

    network {
      port "control" { static = 7733 }
      port "metrics" { static = 9401 }
    }

    service {
      name     = "rewarm-agent"
      port     = "control"
      provider = "consul"

      check {
        type     = "tcp"
        interval = "10s"
        timeout  = "2s"
      }
    }

    task "agent" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        # models to serve are directories under the snapshot volume (config.json +
        # model.safetensors), placed there by the operator or a prestart task
        args    = ["agent", "run", "--state-dir", "/var/lib/rewarm",
                   "--model-dir", "/var/lib/rewarm/models/default",
                   "--listen", "0.0.0.0:${NOMAD_PORT_control}", "--registry", "consul",
                   "--metrics-listen", "0.0.0.0:${NOMAD_PORT_metrics}", "--drain-grace-s", "30"]
      }

      # the drain (--drain-grace-s 30) plus 10 s; Nomad caps this at the client's
      # max_kill_timeout (30 s unless raised in the client configuration)
      kill_timeout = "40s"

      # The control API's shared secret, from Nomad Variables (`nomad var put nomad/jobs
      # control_token=...`): the agent requires it beyond loopback, its clients send it.
      template {
        data        = <<-EOT
          REWARM_CONTROL_TOKEN={{ with nomadVar "nomad/jobs" }}{{ .control_token }}{{ end }}
          EOT
        destination = "secrets/control.env"
        env         = true
      }

      volume_mount {
        volume      = "snapshots"
        destination = "/var/lib/rewarm"
      }

      resources {
        cpu    = 2000
        memory = 4096

        device "nvidia/gpu" {
          count = 1
        }
      }
    }
  }
}
