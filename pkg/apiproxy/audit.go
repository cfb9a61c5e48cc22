package apiproxy

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
)

// Every proxied request, refused or forwarded, gets one audit line and
// counts in the proxy's metrics, with what it wrote.

// done writes the request's audit line and metrics.
func (p *Proxy) done(rw *recorder, r *http.Request, cluster types.NamespacedName, credentialID, user string, err error, took time.Duration) {
	code := rw.code
	if code == 0 {
		code = http.StatusOK
	}
	// Only a ClusterProfile that a live token was authorized for labels
	// the metrics: anyone may send any path.
	label := ""
	if user != "" {
		label = cluster.String()
	}
	p.metrics.requests.WithLabelValues(label, strconv.Itoa(code)).Inc()
	p.metrics.bytes.WithLabelValues(label).Add(float64(rw.bytes))
	kv := []any{"credentialID", credentialID, "cluster", cluster.String(), "user", user, "verb", r.Method,
		"path", clip(r.URL.Path), "code", code, "bytes", rw.bytes, "durationSeconds", took.Seconds()}
	if err != nil {
		kv = append(kv, "reason", err.Error())
	}
	p.cfg.Audit.Info("apiproxy request", kv...)
}

// recorder counts what is written to a response; Unwrap gives
// http.ResponseController the writer beneath, to flush and to hijack.
type recorder struct {
	http.ResponseWriter
	code  int
	bytes int64
}

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	n, err := r.ResponseWriter.Write(b)
	r.bytes += int64(n)
	return n, err
}

func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

type proxyMetrics struct {
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec
}

func newProxyMetrics(reg prometheus.Registerer) (*proxyMetrics, error) {
	m := &proxyMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "credbroker_apiproxy_requests_total",
			Help: "Requests to the API proxy, by ClusterProfile (empty unless a live token of it was authorized) and HTTP code.",
		}, []string{"cluster", "code"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "credbroker_apiproxy_response_bytes_total",
			Help: "Response body bytes the API proxy wrote, by ClusterProfile.",
		}, []string{"cluster"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.requests, m.bytes} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("apiproxy: register metrics: %w", err)
			}
		}
	}
	return m, nil
}
