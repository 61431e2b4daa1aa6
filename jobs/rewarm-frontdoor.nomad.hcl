# The front door: stateless service, found by clients through Consul (rewarm-frontdoor).
# It learns the models it serves, and their policies, from the catalog in Consul KV
# (rewarm/models/<model>, rewarm/snapshots/<model>), so no --model list is needed, and asks
# for capacity through Nomad: it scales rewarm-replica-<model> (the scaler), never restores
# on a node agent itself, so every GPU it brings up is held by a Nomad allocation.

variable "consul_addr" {
  type    = string
  default = "127.0.0.1:8500"
}

variable "nomad_addr" {
  type    = string
  default = "http://127.0.0.1:4646"
}

variable "api_port" {
  type    = number
  default = 7000
}

variable "tokens_file" {
  type        = string
  default     = "/etc/rewarm/tokens"
  description = "tenant:token lines (front door auth)"
}

job "rewarm-frontdoor" {
  type        = "service"
  datacenters = ["*"]

  update {
    max_parallel     = 1
    health_check     = "checks"
    min_healthy_time = "10s"
    healthy_deadline = "2m"
    auto_revert      = true
  }

  group "frontdoor" {
    count = 2

    restart {
      attempts = 3
      interval = "2m"
      delay    = "2s"
      mode     = "delay"
    }

    reschedule {
      delay          = "5s"
      delay_function = "exponential"
      max_delay      = "2m"
      unlimited      = true
    }

    # Out of Consul first, then SIGTERM: Nomad deregisters the group's services, waits
    # shutdown_delay, then signals the task, so clients stop choosing this front door before
    # it drains (a group argument in Nomad; a service block has none).
    shutdown_delay = "5s"

    network {
      port "api" { static = var.api_port }
      port "metrics" {}
      port "http" { static = 8000 } # the OpenAI-compatible HTTP entrance
    }

    service {
      name     = "rewarm-frontdoor"
      port     = "api"
      provider = "consul"

      check {
        type     = "tcp"
        interval = "5s"
        timeout  = "2s"
      }
    }

    service {
      name     = "rewarm-frontdoor-metrics"
      port     = "metrics"
      provider = "consul"

      check {
        type     = "http"
        path     = "/metrics"
        interval = "10s"
        timeout  = "2s"
      }
    }

    # The OpenAI-compatible HTTP entrance; passing while the front door can serve or restore.
    service {
      name     = "rewarm-frontdoor-http"
      port     = "http"
      provider = "consul"

      check {
        type     = "http"
        path     = "/ready"
        interval = "5s"
        timeout  = "2s"
      }
    }

    task "frontdoor" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        args    = ["frontdoor", "--host", "${attr.unique.network.ip-address}",
                   "--port", "${NOMAD_PORT_api}", "--http-port", "${NOMAD_PORT_http}",
                   "--consul", var.consul_addr,
                   "--scaler", "nomad", "--tokens", var.tokens_file,
                   "--metrics-port", "${NOMAD_PORT_metrics}", "--drain-grace-s", "25"]
      }

      env {
        NOMAD_ADDR = var.nomad_addr
      }

      # NOMAD_TOKEN for its scale calls: a workload identity token, bound by the operator
      # to a policy with the scale-job capability (docs/cluster.md, "ACL").
      identity {
        env = true
      }

      template {
        data        = <<-EOT
          REWARM_CONTROL_TOKEN={{ with nomadVar "nomad/jobs" }}{{ .control_token }}{{ end }}
          EOT
        destination = "secrets/control.env"
        env         = true
      }

      # Consul's ACL token for this task (CONSUL_HTTP_TOKEN, which py-consul reads), rendered
      # from Nomad Variables: `nomad var put nomad/jobs/rewarm-frontdoor consul_token=<SecretID>` of a
      # token carrying this job's Consul policy (docs/cluster.md, "ACL").  Empty when unset
      # (Consul without ACLs).
      template {
        data        = <<-EOT
          CONSUL_HTTP_TOKEN={{ with nomadVar "nomad/jobs/rewarm-frontdoor" }}{{ .consul_token }}{{ end }}
          EOT
        destination = "secrets/consul.env"
        env         = true
      }

      kill_signal = "SIGTERM"
      # The drain grace (--drain-grace-s 25: streams finish, new requests get 503) plus a 5 s
      # margin, within the client's default max_kill_timeout (30 s), which caps any longer value.
      kill_timeout = "30s"

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }
}
