# The predictor: two instances, one leader (Consul session lock rewarm/predictor/leader).
job "rewarm-predictor" {
  type        = "service"
  datacenters = ["*"]

  # the models to manage, NAME:MIN:MAX (one per instance of the --model flag)
  meta {
    models = "smollm2:0:8"
  }

  group "predictor" {
    count = 2

    network {
      port "metrics" {}
    }

    service {
      name     = "rewarm-predictor"
      port     = "metrics"
      provider = "consul"

      check {
        type     = "http"
        path     = "/metrics"
        interval = "10s"
        timeout  = "2s"
      }
    }

    task "predictor" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        args    = ["predictor", "--model", "${NOMAD_META_models}", "--registry", "consul",
                   "--consul", "${attr.unique.network.ip-address}:8500", "--scaler", "nomad",
                   "--metrics-port", "${NOMAD_PORT_metrics}"]
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
