package framework

import (
	"bytes"
	"encoding/json"
	"fmt"

	"github.com/go-logr/logr"
)

// auditLines passes each JSON line written to it on to log, as the message
// and key/value pairs of the line (time, level and logger dropped), so that
// the exchange lines a replica encodes itself for its audit file
// (broker.Config.AuditLog) are in the test log too, as the other audit
// lines are.
type auditLines struct{ log logr.Logger }

func (a auditLines) Write(p []byte) (int, error) {
	dec := json.NewDecoder(bytes.NewReader(p))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return 0, fmt.Errorf("framework: an audit line is not a JSON object: %q", p)
	}
	var msg string
	var kv []any
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return 0, fmt.Errorf("framework: audit line %q: %w", p, err)
		}
		var v any
		if err := dec.Decode(&v); err != nil {
			return 0, fmt.Errorf("framework: audit line %q: %w", p, err)
		}
		switch key {
		case "msg":
			msg, _ = v.(string)
		case "time", "level", "logger":
		default:
			kv = append(kv, key, v)
		}
	}
	a.log.Info(msg, kv...)
	return len(p), nil
}
