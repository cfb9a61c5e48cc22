package cmdflags

import (
	"path/filepath"
	"testing"
	"time"
)

// BenchmarkAuditLog is one exchange's audit line, as the broker binary
// writes it to an --audit-log-path file, in each --audit-log-mode.
func BenchmarkAuditLog(b *testing.B) {
	for _, mode := range []string{AuditBlocking, AuditBatch} {
		b.Run("mode="+mode, func(b *testing.B) {
			a := AuditFlags{Path: filepath.Join(b.TempDir(), "audit.log"), MaxSize: 100, Mode: mode}
			w, err := a.Open()
			if err != nil {
				b.Fatal(err)
			}
			defer w.Close()
			log := AuditLogger(w)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					log.Info("exchange", "cluster", "fleet/spoke-1", "requestedServiceAccount", "team-a/deployer",
						"audiences", []string{"https://kubernetes.default.svc"}, "code", "OK", "cacheHit", true,
						"latency", (137 * time.Microsecond).String(), "user", "system:serviceaccount:argocd:argocd-application-controller",
						"uid", "8d3c1b2a-0f9e-4d8c-b7a6-5e4f3d2c1b0a", "serviceAccount", "team-a/deployer",
						"tokenAudiences", []string{"https://kubernetes.default.svc"}, "expiration", "2026-11-30T20:00:00Z",
						"credentialID", "JTI=3f2b6c1e-5d7a-4e8b-9c0d-1a2b3c4d5e6f")
				}
			})
		})
	}
}
