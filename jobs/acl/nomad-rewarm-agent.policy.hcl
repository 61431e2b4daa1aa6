# Nomad ACL policy for the node agent's workload identity:
#   nomad acl policy apply -namespace default -job rewarm-agent rewarm-agent nomad-rewarm-agent.policy.hcl
# POST /v1/client/metadata (the cached snapshots as dynamic node metadata) needs node write.
node {
  policy = "write"
}
