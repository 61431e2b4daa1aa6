# The front door: stateless service, found by clients through Consul.
job "rewarm-frontdoor" {
  type        = "service"
  datacenters = ["*"]

  group "frontdoor" {
    count = 2

    network {
      port "api" { static = 7000 }
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
        args    = ["frontdoor", "--host", "0.0.0.0", "--port", "${NOMAD_PORT_api}",
                   "--http-port", "${NOMAD_PORT_http}",
                   "--consul", "${attr.unique.network.ip-address}:8500",
                   "--tokens", "/etc/rewarm/tokens", "--metrics-port", "9400"]
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }
}
