# The front door: stateless service, found by clients through Consul.
job "rewarm-frontdoor" {
  type        = "service"
  datacenters = ["*"]

  group "frontdoor" {
    count = 2

    network {
      port "api" { static = 7000 }
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

    task "frontdoor" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        args    = ["frontdoor", "--host", "0.0.0.0", "--port", "${NOMAD_PORT_api}",
                   "--consul", "${attr.unique.network.ip-address}:8500",
                   "--tokens", "/etc/rewarm/tokens", "--metrics-port", "9400",
                   "--drain-grace-s", "30"]
      }

      # the drain (--drain-grace-s 30: streams finish, new requests get 503) plus 10 s;
      # Nomad caps this at the client's max_kill_timeout (30 s unless raised)
      kill_timeout = "40s"

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }
}
