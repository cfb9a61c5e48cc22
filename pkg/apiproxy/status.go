package apiproxy

import (
	"encoding/json"
	"errors"
	"net/http"
	"strings"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// The proxy's answers of its own: Kubernetes Status objects, whose texts
// never carry a bearer token or a long path.

// writeStatus answers err as the Kubernetes API does, with a Status whose
// code and reason follow err's errdefs sentinel.
func writeStatus(w http.ResponseWriter, err error) {
	code, reason := http.StatusBadGateway, "ServiceUnavailable"
	switch {
	case errors.Is(err, errdefs.ErrUnauthenticated):
		code, reason = http.StatusUnauthorized, "Unauthorized"
	case errors.Is(err, errdefs.ErrNotFound):
		code, reason = http.StatusNotFound, "NotFound"
	case errors.Is(err, errdefs.ErrResourceExhausted):
		code, reason = http.StatusTooManyRequests, "TooManyRequests"
		w.Header().Set("Retry-After", "1")
	case errors.Is(err, errdefs.ErrUnavailable):
		code, reason = http.StatusServiceUnavailable, "ServiceUnavailable"
	}
	body, _ := json.Marshal(map[string]any{
		"kind": "Status", "apiVersion": "v1", "metadata": map[string]any{},
		"status": "Failure", "message": "credbroker: " + err.Error(), "reason": reason, "code": code,
	})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_, _ = w.Write(body)
}

// redactError returns err's text without the bearer in it.
func redactError(err error, bearer string) string {
	return strings.ReplaceAll(err.Error(), bearer, "[redacted]")
}

func clip(s string) string {
	const max = 256
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
}
