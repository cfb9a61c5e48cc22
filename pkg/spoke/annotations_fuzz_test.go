package spoke

import (
	"errors"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/credbroker/credbroker/pkg/errdefs"
)

// FuzzOptInAnnotations parses arbitrary opt-in annotations. Entries are
// trimmed and never empty or hold a comma; a subject is allowed only by an
// exact username entry or a group: entry naming one of its groups, never
// by a wildcard; an audience is allowed only if listed, and a refusal is
// PermissionDenied.
func FuzzOptInAnnotations(f *testing.F) {
	f.Add("system:serviceaccount:argocd:controller, group:system:serviceaccounts:argocd", "system:serviceaccount:argocd:controller", "system:serviceaccounts:argocd", "https://kubernetes.default.svc")
	f.Add("*", "group:x", "x", "*")
	f.Add(" , ,group:,", "", "", "")
	f.Add("group:a,b", "group:a", "b", "a,b")
	f.Fuzz(func(t *testing.T, annotation, user, group, audience string) {
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "sa", Annotations: map[string]string{
			AllowedSubjectsAnnotation: annotation, AllowedAudiencesAnnotation: annotation,
		}}}
		subjects := AllowedSubjects(sa)
		for _, e := range subjects {
			if e == "" || e != strings.TrimSpace(e) || strings.Contains(e, ",") {
				t.Fatalf("entry %q of %q", e, annotation)
			}
		}
		if allows(sa, user, nil) && (!slices.Contains(subjects, user) || strings.HasPrefix(user, GroupSubjectPrefix)) {
			t.Fatalf("%q allowed by %q without an exact entry", user, annotation)
		}
		if allows(sa, "", []string{group}) && (group == "" || !slices.Contains(subjects, GroupSubjectPrefix+group)) {
			t.Fatalf("group %q allowed by %q without its entry", group, annotation)
		}
		err := allowAudiences(sa, []string{audience})
		if err == nil && !slices.Contains(AllowedAudiences(sa), audience) {
			t.Fatalf("audience %q allowed by %q without an entry", audience, annotation)
		}
		if err != nil && !errors.Is(err, errdefs.ErrPermissionDenied) {
			t.Fatalf("refusal %v is not PermissionDenied", err)
		}
	})
}
