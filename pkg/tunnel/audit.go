package tunnel

import "github.com/credbroker/credbroker/pkg/errdefs"

// agentStream names an agent stream in the audit: the agent's SPIFFE ID,
// its instance (instanceHeader) and its cluster, each empty while unknown.
type agentStream struct{ agent, instance, cluster string }

// stream names sess in the audit.
func (sess *session) stream() agentStream {
	return agentStream{sess.agent.String(), sess.instance, sess.cluster.String()}
}

// auditAgent writes one audit line of an agent stream: msg is "agent
// connected", "agent disconnected" or "agent refused"; err, nil when all
// went well, gives the code and the reason.
func (s *Server) auditAgent(msg string, who agentStream, err error, kv ...any) {
	line := []any{"spiffeID", who.agent, "instance", who.instance, "cluster", who.cluster, "code", errdefs.Code(err).String()}
	if err != nil {
		line = append(line, "reason", err.Error())
	}
	s.cfg.Audit.Info(msg, append(line, kv...)...)
}
