package spoke

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BenchmarkAllows is the policy check of every mint, against an annotation
// of 50 entries whose match is the last (benchstat: make bench-go).
func BenchmarkAllows(b *testing.B) {
	var entries []string
	for i := range 49 {
		entries = append(entries, fmt.Sprintf("system:serviceaccount:team-%d:controller", i))
	}
	entries = append(entries, "group:"+argocdGroup)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		AllowedSubjectsAnnotation: strings.Join(entries, ","),
	}}}
	groups := []string{"system:serviceaccounts", argocdGroup, "system:authenticated"}
	b.ReportAllocs()
	for b.Loop() {
		if !allows(sa, argocd, groups) {
			b.Fatal("not allowed")
		}
	}
}

// BenchmarkAllowAudiences is the audience check of a mint that asks for
// one audience listed among 20.
func BenchmarkAllowAudiences(b *testing.B) {
	var auds []string
	for i := range 20 {
		auds = append(auds, fmt.Sprintf("https://aud-%d.example", i))
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
		AllowedAudiencesAnnotation: strings.Join(auds, ","),
	}}}
	want := []string{auds[19]}
	b.ReportAllocs()
	for b.Loop() {
		if err := allowAudiences(sa, want); err != nil {
			b.Fatal(err)
		}
	}
}
