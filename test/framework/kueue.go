package framework

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	inventory "sigs.k8s.io/cluster-inventory-api/client/clientset/versioned"
	"sigs.k8s.io/cluster-inventory-api/pkg/access"
	"sigs.k8s.io/yaml"
)

const (
	// KueueConfigAPIVersion is the version of Kueue's Configuration that has
	// multiKueue.clusterProfile.accessProviders (Kueue v0.19 and later).
	KueueConfigAPIVersion = "config.kueue.x-k8s.io/v1beta2"
	// KueueClusterProfileGate is the feature gate without which Kueue reads
	// no ClusterProfile.
	KueueClusterProfileGate = "MultiKueueClusterProfile"
	// KueueDefaultNamespace is the namespace Kueue reads ClusterProfiles
	// from when its Configuration names none and it runs outside a pod.
	KueueDefaultNamespace = "kueue-system"
)

// KueueConfiguration mirrors the fields of Kueue's Configuration
// (apis/config/v1beta2/configuration_types.go, as of Kueue v0.19.2) that
// its MultiKueue ClusterProfile support reads. ParseKueueConfiguration
// refuses any other field, as Kueue's strict decoder refuses fields it does
// not know: a file that parses here holds only these.
type KueueConfiguration struct {
	APIVersion   string           `json:"apiVersion"`
	Kind         string           `json:"kind"`
	Namespace    *string          `json:"namespace,omitempty"`
	FeatureGates map[string]bool  `json:"featureGates,omitempty"`
	MultiKueue   *KueueMultiKueue `json:"multiKueue,omitempty"`
}

// KueueMultiKueue mirrors the clusterProfile field of Kueue's MultiKueue.
type KueueMultiKueue struct {
	ClusterProfile *KueueClusterProfile `json:"clusterProfile,omitempty"`
}

// KueueClusterProfile mirrors Kueue's ClusterProfile configuration:
// credentialsProviders is the deprecated name of accessProviders (Kueue
// v0.15 to v0.18 know only it), and the two are mutually exclusive.
type KueueClusterProfile struct {
	AccessProviders      []KueueAccessProvider `json:"accessProviders,omitempty"`
	CredentialsProviders []KueueAccessProvider `json:"credentialsProviders,omitempty"`
}

// KueueAccessProvider mirrors Kueue's ClusterProfileAccessProvider: a
// provider name and client-go's own ExecConfig.
type KueueAccessProvider struct {
	Name       string                  `json:"name"`
	ExecConfig clientcmdapi.ExecConfig `json:"execConfig"`
}

// KueueMultiKueueCluster mirrors Kueue's MultiKueueCluster
// (kueue.x-k8s.io/v1beta2) as far as a ClusterProfile reference goes.
type KueueMultiKueueCluster struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		ClusterSource struct {
			ClusterProfileRef *struct {
				Name string `json:"name"`
			} `json:"clusterProfileRef,omitempty"`
		} `json:"clusterSource"`
	} `json:"spec"`
}

// ParseKueueConfiguration reads a Kueue Configuration strictly and
// validates it as Kueue does (pkg/config/validation.go) for what
// MultiKueue's ClusterProfile support needs: the feature gate on, one of
// accessProviders and credentialsProviders, and each provider with a name,
// a command, an apiVersion and a valid interactiveMode.
func ParseKueueConfiguration(raw []byte) (*KueueConfiguration, error) {
	var c KueueConfiguration
	if err := yaml.UnmarshalStrict(raw, &c); err != nil {
		return nil, fmt.Errorf("framework: kueue configuration: %w", err)
	}
	var errs []error
	if c.APIVersion != KueueConfigAPIVersion || c.Kind != "Configuration" {
		errs = append(errs, fmt.Errorf("is %s %s, not %s Configuration", c.APIVersion, c.Kind, KueueConfigAPIVersion))
	}
	if !c.FeatureGates[KueueClusterProfileGate] {
		errs = append(errs, fmt.Errorf("featureGates does not turn %s on: Kueue reads no ClusterProfile", KueueClusterProfileGate))
	}
	if c.MultiKueue == nil || c.MultiKueue.ClusterProfile == nil {
		errs = append(errs, errors.New("has no multiKueue.clusterProfile"))
	} else {
		cp := c.MultiKueue.ClusterProfile
		if len(cp.AccessProviders) > 0 && len(cp.CredentialsProviders) > 0 {
			errs = append(errs, errors.New("multiKueue.clusterProfile.credentialsProviders must not be specified when accessProviders is specified"))
		}
		for _, p := range append(append([]KueueAccessProvider(nil), cp.AccessProviders...), cp.CredentialsProviders...) {
			e := p.ExecConfig
			if p.Name == "" {
				errs = append(errs, errors.New("a provider has no name"))
			}
			if e.Command == "" {
				errs = append(errs, fmt.Errorf("provider %s: execConfig.command must be specified", p.Name))
			}
			if e.APIVersion == "" {
				errs = append(errs, fmt.Errorf("provider %s: execConfig.apiVersion must be specified", p.Name))
			}
			switch e.InteractiveMode {
			case clientcmdapi.NeverExecInteractiveMode, clientcmdapi.IfAvailableExecInteractiveMode, clientcmdapi.AlwaysExecInteractiveMode:
			default:
				errs = append(errs, fmt.Errorf("provider %s: execConfig.interactiveMode %q: must be Never, IfAvailable or Always", p.Name, e.InteractiveMode))
			}
			for _, v := range e.Env {
				if v.Name == "" {
					errs = append(errs, fmt.Errorf("provider %s: execConfig.env: a variable has no name", p.Name))
				}
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("framework: kueue configuration: %w", err)
	}
	return &c, nil
}

// ParseKueueMultiKueueCluster reads a MultiKueueCluster strictly; it must
// reference a ClusterProfile.
func ParseKueueMultiKueueCluster(raw []byte) (*KueueMultiKueueCluster, error) {
	var m KueueMultiKueueCluster
	if err := yaml.UnmarshalStrict(raw, &m); err != nil {
		return nil, fmt.Errorf("framework: kueue MultiKueueCluster: %w", err)
	}
	if m.APIVersion != "kueue.x-k8s.io/v1beta2" || m.Kind != "MultiKueueCluster" {
		return nil, fmt.Errorf("framework: kueue MultiKueueCluster: is %s %s", m.APIVersion, m.Kind)
	}
	if ref := m.Spec.ClusterSource.ClusterProfileRef; ref == nil || ref.Name == "" {
		return nil, fmt.Errorf("framework: kueue MultiKueueCluster %s: no spec.clusterSource.clusterProfileRef.name", m.Metadata.Name)
	}
	return &m, nil
}

// ClusterProfileNamespace is where Kueue looks for the ClusterProfiles
// that MultiKueueClusters name: its own namespace.
func (c *KueueConfiguration) ClusterProfileNamespace() string {
	if c.Namespace != nil && *c.Namespace != "" {
		return *c.Namespace
	}
	return KueueDefaultNamespace
}

// AccessConfig is the cluster-inventory-api access configuration that
// Kueue builds from the Configuration
// (pkg/controller/admissionchecks/multikueue/controllers.go): the
// accessProviders, or the credentialsProviders when there are none, each
// as a provider with its name and exec config and no profile-sourced
// arguments or variables.
func (c *KueueConfiguration) AccessConfig() *access.Config {
	providers := c.MultiKueue.ClusterProfile.AccessProviders
	if len(providers) == 0 {
		providers = c.MultiKueue.ClusterProfile.CredentialsProviders
	}
	p := make([]access.Provider, 0, len(providers))
	for i := range providers {
		p = append(p, access.Provider{Name: providers[i].Name, ExecConfig: &providers[i].ExecConfig})
	}
	return access.New(p)
}

// KueueRESTConfig is the client configuration Kueue's MultiKueueCluster
// reconciler builds for m (multikueuecluster.go, loadClientConfig): it gets
// the ClusterProfile spec.clusterSource.clusterProfileRef.name from the
// Configuration's namespace, builds the config with cluster-inventory-api's
// pkg/access, and checks it as Kueue does (validateRestConfig, exec
// plugins allowed).
func KueueRESTConfig(ctx context.Context, inv inventory.Interface, c *KueueConfiguration, m *KueueMultiKueueCluster) (*rest.Config, error) {
	name := m.Spec.ClusterSource.ClusterProfileRef.Name
	cp, err := inv.ApisV1alpha1().ClusterProfiles(c.ClusterProfileNamespace()).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("framework: kueue: BadClusterProfile: %w", err)
	}
	cfg, err := c.AccessConfig().BuildConfigFromCP(cp)
	if err != nil {
		return nil, fmt.Errorf("framework: kueue: BadClusterProfile: %w", err)
	}
	if err := validateKueueRESTConfig(cfg); err != nil {
		return nil, fmt.Errorf("framework: kueue: BadRestConfig: %w", err)
	}
	return cfg, nil
}

// validateKueueRESTConfig mirrors Kueue's validateRestConfig with exec
// plugins allowed, as for ClusterProfiles.
func validateKueueRESTConfig(cfg *rest.Config) error {
	if cfg.BearerTokenFile != "" {
		return errors.New("bearerTokenFile is not allowed")
	}
	u, err := url.Parse(strings.ToLower(cfg.Host))
	if err != nil {
		return errors.New("untrusted server endpoint")
	}
	host, _, err := net.SplitHostPort(u.Host)
	if err != nil {
		host = u.Host
	}
	if net.ParseIP(host) == nil && len(validation.IsDNS1123Subdomain(host)) > 0 {
		return errors.New("untrusted server endpoint")
	}
	if cfg.Username != "" || cfg.Password != "" {
		return errors.New("basic auth is not allowed")
	}
	if cfg.AuthProvider != nil {
		return errors.New("auth providers are not allowed")
	}
	return nil
}
