# Consul ACL policy for the front door's token (`nomad var put nomad/jobs/rewarm-frontdoor
# consul_token=<SecretID>`):
#   consul acl policy create -name rewarm-frontdoor -rules @consul-rewarm-frontdoor.policy.hcl
# It registers its entrances, watches the replicas and agents (health needs node read too:
# results are filtered by it), and reads the model catalog.
service_prefix "rewarm-frontdoor" {
  policy = "write"
}
service_prefix "" {
  policy = "read"
}
node_prefix "" {
  policy = "read"
}
key_prefix "rewarm/" {
  policy = "read"
}
