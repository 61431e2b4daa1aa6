# Consul ACL policy for the predictor's token (`nomad var put nomad/jobs/rewarm-predictor
# frontdoor_token=... consul_token=<SecretID>`):
#   consul acl policy create -name rewarm-predictor -rules @consul-rewarm-predictor.policy.hcl
# The leader lock: a session (session write on the node), the key it holds, and the TTL
# check service rewarm-predictor-leader-<alloc> the leader passes each tick; the front doors
# found through health; the catalog read.
session_prefix "" {
  policy = "write"
}
key "rewarm/predictor/leader" {
  policy = "write"
}
key_prefix "rewarm/" {
  policy = "read"
}
service_prefix "rewarm-predictor" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
