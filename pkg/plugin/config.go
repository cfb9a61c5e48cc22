package plugin

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	sigsjson "sigs.k8s.io/json"
)

// Name is the plugin's name: the access-provider name in ClusterProfile
// status and in cluster-inventory-api provider files, and the prefix of the
// plugin's error messages.
const Name = "credbroker"

// ExecConfig is what the plugin reads from ExecCredential spec.cluster.config,
// that is from the "client.authentication.k8s.io/exec" extension of the
// cluster of the ClusterProfile's credbroker access provider.
type ExecConfig struct {
	// ClusterProfile names the ClusterProfile, on the hub, of the spoke to
	// get a token for.
	ClusterProfile *Reference `json:"clusterProfile,omitempty"`
}

// Reference names a namespaced object on the hub, such as a ClusterProfile,
// or on a spoke, such as a ServiceAccount.
type Reference struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

// String returns "<namespace>/<name>", the form ParseReference reads.
func (r Reference) String() string { return r.Namespace + "/" + r.Name }

// Validate returns an error unless Namespace is an RFC 1123 label and Name
// an RFC 1123 subdomain, as Kubernetes requires of namespaces and of
// ClusterProfile and ServiceAccount names.
func (r Reference) Validate() error {
	if r.Namespace == "" {
		return errors.New("namespace is required")
	}
	if msgs := validation.IsDNS1123Label(r.Namespace); len(msgs) > 0 {
		return fmt.Errorf("namespace %q is invalid: %s", r.Namespace, strings.Join(msgs, "; "))
	}
	if r.Name == "" {
		return errors.New("name is required")
	}
	if msgs := validation.IsDNS1123Subdomain(r.Name); len(msgs) > 0 {
		return fmt.Errorf("name %q is invalid: %s", r.Name, strings.Join(msgs, "; "))
	}
	return nil
}

// ParseReference parses "<namespace>/<name>", as given to the --cluster and
// --service-account flags, and validates both parts.
func ParseReference(s string) (Reference, error) {
	ns, name, ok := strings.Cut(s, "/")
	if !ok {
		return Reference{}, fmt.Errorf("%q is not of the form <namespace>/<name>", s)
	}
	r := Reference{Namespace: ns, Name: name}
	if err := r.Validate(); err != nil {
		return Reference{}, fmt.Errorf("%q: %w", s, err)
	}
	return r, nil
}

// execConfigShape is the shape ParseExecConfig accepts, for error messages.
const execConfigShape = `want {"clusterProfile": {"namespace": "<namespace>", "name": "<name>"}}`

// ParseExecConfig parses and validates raw, the JSON of ExecCredential
// spec.cluster.config. It is strict: raw must be one JSON object with a
// clusterProfile whose namespace and name are valid; field names are
// case-sensitive, and unknown or duplicate fields are errors. Empty input and
// null are errors too.
func ParseExecConfig(raw []byte) (ExecConfig, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return ExecConfig{}, fmt.Errorf("exec config is empty; %s", execConfigShape)
	}
	if raw[0] != '{' {
		return ExecConfig{}, fmt.Errorf("exec config is not a JSON object; %s", execConfigShape)
	}
	var c ExecConfig
	strictErrs, err := sigsjson.UnmarshalStrict(raw, &c)
	if err != nil {
		return ExecConfig{}, fmt.Errorf("exec config: %w; %s", err, execConfigShape)
	}
	if len(strictErrs) > 0 {
		msgs := make([]string, len(strictErrs))
		for i, e := range strictErrs {
			msgs[i] = e.Error()
		}
		return ExecConfig{}, fmt.Errorf("exec config: %s; %s", strings.Join(msgs, "; "), execConfigShape)
	}
	if c.ClusterProfile == nil {
		return ExecConfig{}, fmt.Errorf("exec config has no clusterProfile; %s", execConfigShape)
	}
	if err := c.ClusterProfile.Validate(); err != nil {
		return ExecConfig{}, fmt.Errorf("exec config clusterProfile: %w", err)
	}
	return c, nil
}
