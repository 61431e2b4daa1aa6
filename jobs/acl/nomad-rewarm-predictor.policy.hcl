# Nomad ACL policy for the predictor's workload identity:
#   nomad acl policy apply -namespace default -job rewarm-predictor rewarm-predictor nomad-rewarm-predictor.policy.hcl
# It scales replica jobs up and down (scale-job), reads their counts (read-job), and
# registers the job of a model that has none yet (parse-job, submit-job).
namespace "default" {
  capabilities = ["scale-job", "read-job", "read-job-scaling", "parse-job", "submit-job"]
}
