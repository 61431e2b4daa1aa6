# Nomad ACL policy for the front door's workload identity:
#   nomad acl policy apply -namespace default -job rewarm-frontdoor rewarm-frontdoor nomad-rewarm-frontdoor.policy.hcl
# It scales a model's replica job (Job.Scale: scale-job), reads its count (read-job), and
# registers the job of a model seen for the first time (parse-job, submit-job).
namespace "default" {
  capabilities = ["scale-job", "read-job", "read-job-scaling", "parse-job", "submit-job"]
}
