package tokenexchange

import (
	"io"
	"testing"
	"time"

	"github.com/go-logr/logr"

	"github.com/credbroker/credbroker/internal/cmdflags"
	"github.com/credbroker/credbroker/pkg/tunnel"
)

// The benchmarks of the cached path, piece by piece, for benchstat: run
// `go test -run '^$' -bench . -benchmem -count 6 ./pkg/tokenexchange/`
// before and after a change (make bench-go).

// BenchmarkTokenKey is the token cache key of every exchange.
func BenchmarkTokenKey(b *testing.B) {
	ref := tunnel.ClusterRef{UID: "3f2b6c1e-5d7a-4e8b-9c0d-1a2b3c4d5e6f"}
	ref.Namespace, ref.Name = "fleet", "spoke-1"
	user := userInfo{Username: "system:serviceaccount:argocd:argocd-application-controller", UID: "8d3c1b2a-0f9e-4d8c-b7a6-5e4f3d2c1b0a",
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:argocd", "system:authenticated"}}
	r := request{audiences: []string{"https://kubernetes.default.svc"}}
	b.ReportAllocs()
	for b.Loop() {
		_ = tokenKey(ref, user, r)
	}
}

// BenchmarkAudit is the audit line of one cached exchange, written by the
// broker binary's JSON audit logger to a discarding writer.
func BenchmarkAudit(b *testing.B) {
	f := newFixture(b, func(c *Config) { c.Audit = cmdflags.AuditLogger(io.Discard) })
	ctx := withBearer(consumerToken)
	req := fleetA()
	rec := &auditRecord{}
	_, err := f.svc.exchange(ctx, req, rec)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		f.svc.audit(rec, req, nil, time.Millisecond)
	}
}

// BenchmarkExchangeCached is a whole cached exchange, without gRPC: with
// the audit line discarded, and with it written as the broker binary does.
func BenchmarkExchangeCached(b *testing.B) {
	for _, bc := range []struct {
		name  string
		audit logr.Logger
	}{
		{"audit=discard", logr.Discard()},
		{"audit=json", cmdflags.AuditLogger(io.Discard)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			f := newFixture(b, func(c *Config) { c.Audit = bc.audit })
			ctx := withBearer(consumerToken)
			if _, err := f.svc.Exchange(ctx, fleetA()); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				req := fleetA()
				for pb.Next() {
					if _, err := f.svc.Exchange(ctx, req); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
