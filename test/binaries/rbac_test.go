package binaries

import (
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/credbroker/credbroker/test/framework"
)

// permission is one verb on one resource ("serviceaccounts/token" for a
// subresource) of an API group, or on a non-resource URL (group "" and a
// resource starting with "/").
type permission struct{ group, resource, verb string }

func (p permission) nonResource() bool { return strings.HasPrefix(p.resource, "/") }

func (p permission) String() string {
	if p.nonResource() {
		return p.verb + " " + p.resource
	}
	g := p.group
	if g == "" {
		g = "core"
	}
	return p.verb + " " + p.resource + " (" + g + ")"
}

// flatten lists every permission of rules. Resource names narrow a rule;
// the check compares group, resource and verb.
func flatten(rules []rbacv1.PolicyRule) []permission {
	var out []permission
	for _, r := range rules {
		for _, v := range r.Verbs {
			for _, u := range r.NonResourceURLs {
				out = append(out, permission{resource: u, verb: v})
			}
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					out = append(out, permission{group: g, resource: res, verb: v})
				}
			}
		}
	}
	return out
}

// unusedExceptions are permissions that deploy/ grants and that no test of
// this suite uses, each with the reason it stays. Keep it short: a
// permission nothing uses is a permission to remove.
var unusedExceptions = map[permission]string{}

// informerList is the reason an unused list stays when the suite saw the
// watch of the same resource. client-go's informers (v0.35) receive their
// initial state in the watch itself (sendInitialEvents, "watch-list")
// where the API server serves that, as the test API servers do; on a hub
// or spoke that does not, they list and then watch, and need both verbs.
const informerList = "an informer's initial list, which this API server streams in the watch (an older one needs the list)"

// usage is what the audit log says one identity did.
type usage struct {
	// used counts the requests per permission that the API server allowed.
	used map[permission]int
	// denied lists the requests it refused with 403: a permission that
	// deploy/ lacks (or an admission policy's refusal).
	denied []string
}

// permissionOf is the permission an audited request needed.
func permissionOf(ev framework.AuditEvent) permission {
	if ev.ObjectRef == nil {
		u, err := url.Parse(ev.RequestURI)
		path := ev.RequestURI
		if err == nil {
			path = u.Path
		}
		return permission{resource: path, verb: ev.Verb}
	}
	res := ev.ObjectRef.Resource
	if ev.ObjectRef.Subresource != "" {
		res += "/" + ev.ObjectRef.Subresource
	}
	return permission{group: ev.ObjectRef.APIGroup, resource: res, verb: ev.Verb}
}

// usageOf reads the cluster's audit log for the requests of subject.
func usageOf(c *framework.Cluster, subject rbacv1.Subject) (usage, error) {
	user, _ := framework.ServiceAccountUser(subject.Namespace, subject.Name)
	events, err := c.AuditEvents(func(ev framework.AuditEvent) bool { return ev.User.Username == user })
	u := usage{used: map[permission]int{}}
	for _, ev := range events {
		p := permissionOf(ev)
		if ev.ResponseStatus != nil && ev.ResponseStatus.Code == 403 {
			u.denied = append(u.denied, fmt.Sprintf("%s: %s %s", p, ev.Verb, ev.RequestURI))
			continue
		}
		u.used[p]++
	}
	return u, err
}

// compare is the verdict on one identity: the report's lines, and an error
// per granted permission that no request used (unless excepted) and per
// refused request.
func compare(role string, granted []permission, u usage, exceptions map[permission]string) ([]string, error) {
	var lines []string
	var errs []error
	for _, p := range granted {
		n := u.used[p]
		verdict := "used"
		switch reason, ok := exceptions[p]; {
		case n > 0:
		case ok:
			verdict = "unused, excepted: " + reason
		case p.verb == "list" && u.used[permission{group: p.group, resource: p.resource, verb: "watch"}] > 0:
			verdict = "unused, excepted: " + informerList
		default:
			verdict = "UNUSED"
			errs = append(errs, fmt.Errorf("%s grants %s, which no test of the suite used: remove it from deploy/ "+
				"(and the allow-list of deploy/deploy_test.go), or add a test that needs it", role, p))
		}
		lines = append(lines, fmt.Sprintf("| %s | %s | %d | %s |", role, p, n, verdict))
	}
	for p := range u.used {
		if !slices.Contains(granted, p) {
			// Allowed by a default role of the API server, such as
			// system:basic-user's selfsubjectreviews.
			lines = append(lines, fmt.Sprintf("| %s | %s | %d | not in deploy/ (a default role allows it) |", role, p, u.used[p]))
		}
	}
	for _, d := range u.denied {
		errs = append(errs, fmt.Errorf("%s was refused %s: deploy/ lacks a permission the code needs", role, d))
	}
	slices.Sort(lines)
	return lines, errors.Join(errs...)
}

// usedVersusGranted compares, for the broker on the hub and the agent on
// the spoke, what deploy/ grants with what the processes did during the
// suite, from the API servers' audit logs, and returns the table.
func usedVersusGranted() (string, error) {
	var b strings.Builder
	b.WriteString("RBAC of deploy/, granted versus used by the processes during the suite:\n")
	b.WriteString("| identity | permission | requests | verdict |\n|---|---|---|---|\n")
	var errs []error
	for _, id := range []struct {
		name    string
		cluster *framework.Cluster
		objs    []*unstructured.Unstructured
		account rbacv1.Subject
	}{
		{"broker (hub)", env.Hub, hubObjs, brokerAccount},
		{"agent (spoke)", spoke, spokeObjs, agentAccount},
	} {
		granted, err := grantedRules(id.objs, id.account)
		if err != nil {
			return b.String(), err
		}
		u, err := usageOf(id.cluster, id.account)
		if err != nil {
			return b.String(), err
		}
		lines, err := compare(id.name, granted, u, unusedExceptions)
		b.WriteString(strings.Join(lines, "\n") + "\n")
		errs = append(errs, err)
	}
	return b.String(), errors.Join(errs...)
}

// The comparison fails on a granted permission that nothing used and on a
// refused request, and passes an excepted one.
func TestCompareUsedAndGranted(t *testing.T) {
	list := permission{resource: "secrets", verb: "list"}
	get := permission{resource: "serviceaccounts", verb: "get"}
	jwks := permission{resource: "/openid/v1/jwks", verb: "get"}
	tests := []struct {
		name       string
		granted    []permission
		u          usage
		exceptions map[permission]string
		wantErr    []string
	}{
		{name: "every permission used", granted: []permission{list, jwks},
			u: usage{used: map[permission]int{list: 3, jwks: 1}}},
		{name: "a permission never used", granted: []permission{list, get},
			u: usage{used: map[permission]int{list: 3}}, wantErr: []string{"get serviceaccounts (core), which no test"}},
		{name: "an unused permission with a documented reason", granted: []permission{list, get},
			u: usage{used: map[permission]int{list: 3}}, exceptions: map[permission]string{get: "only on a path no test takes"}},
		{name: "list of a watched resource", granted: []permission{list, {resource: "secrets", verb: "watch"}},
			u: usage{used: map[permission]int{{resource: "secrets", verb: "watch"}: 1}}},
		{name: "list of a resource nothing watches", granted: []permission{list, jwks},
			u: usage{used: map[permission]int{jwks: 1}}, wantErr: []string{"list secrets (core), which no test"}},
		{name: "a request refused", granted: []permission{list},
			u:       usage{used: map[permission]int{list: 3}, denied: []string{"delete secrets (core): delete /api/v1/namespaces/x/secrets/y"}},
			wantErr: []string{"was refused delete secrets"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := compare("agent", tt.granted, tt.u, tt.exceptions)
			if len(tt.wantErr) == 0 {
				assert.NoError(t, err)
				return
			}
			for _, want := range tt.wantErr {
				assert.ErrorContains(t, err, want)
			}
		})
	}
}

func TestPermissionOf(t *testing.T) {
	ev := framework.AuditEvent{Verb: "get", RequestURI: "/openid/v1/jwks?x=1"}
	assert.Equal(t, permission{resource: "/openid/v1/jwks", verb: "get"}, permissionOf(ev))
	ev = framework.AuditEvent{Verb: "create", RequestURI: "/api/v1/namespaces/a/serviceaccounts/b/token"}
	ev.ObjectRef = &framework.AuditObjectRef{Resource: "serviceaccounts", Subresource: "token", Namespace: "a", Name: "b"}
	assert.Equal(t, permission{resource: "serviceaccounts/token", verb: "create"}, permissionOf(ev))
}
