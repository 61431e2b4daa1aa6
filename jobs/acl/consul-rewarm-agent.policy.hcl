# Consul ACL policy for the node agent's token (stored for its task as
# `nomad var put nomad/jobs/rewarm-agent consul_token=<SecretID>`):
#   consul acl policy create -name rewarm-agent -rules @consul-rewarm-agent.policy.hcl
# It registers itself and the replicas it runs, with TTL checks it passes, and writes the
# model catalog and snapshot summaries under rewarm/.
service_prefix "rewarm-agent" {
  policy = "write"
}
service "rewarm-replica" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
key_prefix "rewarm/" {
  policy = "write"
}
