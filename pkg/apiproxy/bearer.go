package apiproxy

import (
	"net/http"
	"strings"
)

// The bearer token of a request: the one credential the proxy checks, and
// the only one it forwards.

// bearerOf returns the request's bearer token.
func bearerOf(r *http.Request) (string, bool) {
	v := r.Header.Values("Authorization")
	if len(v) != 1 {
		return "", false
	}
	scheme, tok, ok := strings.Cut(v[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") || tok == "" {
		return "", false
	}
	return strings.TrimSpace(tok), true
}

// webSocketBearerPrefix starts a WebSocket subprotocol in which
// kube-apiserver accepts a bearer token (base64url-encoded).
const webSocketBearerPrefix = "base64url.bearer.authorization.k8s.io."

// dropBearerProtocols removes from h's Sec-WebSocket-Protocol the
// subprotocols that carry a bearer token.
func dropBearerProtocols(h http.Header) {
	values := h.Values("Sec-WebSocket-Protocol")
	if len(values) == 0 {
		return
	}
	var keep []string
	for _, v := range values {
		for p := range strings.SplitSeq(v, ",") {
			if p = strings.TrimSpace(p); p != "" && !strings.HasPrefix(p, webSocketBearerPrefix) {
				keep = append(keep, p)
			}
		}
	}
	h.Del("Sec-WebSocket-Protocol")
	if len(keep) > 0 {
		h.Set("Sec-WebSocket-Protocol", strings.Join(keep, ", "))
	}
}
